"""sgl's kernel operators: the contract between the core and kernel plugins.

Each operator is declared here with torch's dispatcher (``torch.library``, namespace ``sgl``) and
given a pure-torch reference implementation (the ``CompositeExplicitAutograd`` kernel), so that
``torch.ops.sgl.<name>`` runs on any device with no plugin installed, correctly and slowly. A
kernel plugin registers a faster implementation for its device (sgl-kernels-cpu:
``TORCH_LIBRARY_IMPL(sgl, CPU, m)`` in C++); the dispatcher then picks it for tensors on that
device, and the calls show in torch's profiler under their ``sgl::`` names.

The reference functions are plain Python functions too (:data:`REFERENCES`): the tests hold
every plugin's kernels to them. The packed weight layouts are part of the contract
(:func:`pack_bf16_weight`, :func:`pack_f32_weight`, and the quantized ones of
:mod:`sgl.kernels.quant`).

Shapes: ``x`` arguments are 2-D ``[T, width]`` with unit stride in the last dimension (a
row-strided view is fine); bfloat16 or float32 unless the schema says otherwise. See
``docs/kernels.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from sgl.kernels import quant

__all__ = ["NAMESPACE", "REFERENCES", "SCHEMAS", "pack_bf16_weight", "pack_f32_weight",
           "pack_int8_weight", "round_x_rows", "unpack_bf16_weight", "unpack_f32_weight",
           "unpack_int8_weight"]

NAMESPACE = "sgl"

#: operator name -> schema (the arguments a plugin's implementation takes)
SCHEMAS = {
    "linear_bf16": "linear_bf16(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor",
    "linear_f32": "linear_f32(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor",
    "linear_q4": "linear_q4(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, "
                 "bool round_x=False) -> Tensor",
    "linear_q8": "linear_q8(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, "
                 "bool round_x=False) -> Tensor",
    "linear_qx16": "linear_qx16(Tensor x, Tensor packed, int bits, Tensor? bias) -> Tensor",
    "linear_w8a8": "linear_w8a8(Tensor x, Tensor packed, Tensor scales, Tensor? bias) -> Tensor",
    "rmsnorm": "rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor",
    "add_rmsnorm": "add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) "
                   "-> (Tensor, Tensor)",
    "rmsnorm_heads": "rmsnorm_heads(Tensor x, Tensor weight, float eps, int head_dim) -> Tensor",
    "silu_mul": "silu_mul(Tensor x) -> Tensor",
    "rotary": "rotary(Tensor x, int heads, int head_dim, int rotary_dim, Tensor cos_sin, "
              "Tensor? positions) -> Tensor",
    "embedding": "embedding(Tensor weight, Tensor ids) -> Tensor",
    "embedding_q": "embedding_q(Tensor qweight, Tensor scales, Tensor ids, ScalarType dtype) "
                   "-> Tensor",
    "argmax": "argmax(Tensor logits) -> Tensor",
    "decode_attention": "decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, "
                        "Tensor(b!) v_pool, Tensor table, Tensor rows, Tensor lens, Tensor loc, "
                        "int num_heads, int num_kv_heads, int head_dim, float scale, "
                        "float softcap, int window) -> Tensor",
    "extend_attention": "extend_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, "
                        "Tensor rows, Tensor q_starts, Tensor prefix_lens, Tensor extend_lens, "
                        "int num_heads, int num_kv_heads, int head_dim, float scale, "
                        "float softcap, int window, Tensor? tree_bits=None) -> Tensor",
}


# -- the packed weight layouts ---------------------------------------------------------------

def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` bfloat16 -> the layout ``linear_bf16`` takes: ``[Np/32, Kp/32, 2, 16, 16,
    2]`` with N and K zero-padded to multiples of 32 (AMX's tile layout: pairs of K values,
    16 columns by 16 K pairs per tile, two tiles of columns per panel)."""
    n, k = weight.shape
    np_, kp = -(-n // 32) * 32, -(-k // 32) * 32
    w = weight.detach()
    if (np_, kp) != (n, k):
        w = F.pad(w, (0, kp - k, 0, np_ - n))
    # [n-pair, half, n, k-block, k-pair, 2] -> [n-pair, k-block, half, k-pair, n, 2]
    return w.reshape(np_ // 32, 2, 16, kp // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def unpack_bf16_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The ``[n, k]`` weight that :func:`pack_bf16_weight` packed."""
    np_, kp = packed.shape[0] * 32, packed.shape[1] * 32
    return packed.permute(0, 2, 4, 1, 3, 5).reshape(np_, kp)[:n, :k]


def pack_f32_weight(weight: torch.Tensor) -> torch.Tensor:
    """``W [N, K]`` float32 -> the layout ``linear_f32`` takes: ``[Np/32, K, 32]`` (32-column
    panels of ``W^T``) with N zero-padded to a multiple of 32."""
    n, k = weight.shape
    np_ = -(-n // 32) * 32
    w = weight.detach()
    if np_ != n:
        w = F.pad(w, (0, 0, 0, np_ - n))
    return w.reshape(np_ // 32, 32, k).transpose(1, 2).contiguous()


def unpack_f32_weight(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[n, K]`` weight that :func:`pack_f32_weight` packed."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n]


# -- the reference implementations -------------------------------------------------------------

def linear_bf16(x: torch.Tensor, packed: torch.Tensor, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` for bfloat16 ``x [M, K]`` and the :func:`pack_bf16_weight` copy of
    ``W``; the products summed in float32, rounded to bfloat16 once. ``bias``: float32 ``[n]``."""
    w = unpack_bf16_weight(packed, n, x.shape[1])
    y = x.float() @ w.float().t()
    return (y if bias is None else y + bias).to(torch.bfloat16)


def linear_f32(x: torch.Tensor, packed: torch.Tensor, n: int,
               bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` for float32 ``x [M, K]`` and the :func:`pack_f32_weight` copy of
    ``W``."""
    return F.linear(x, unpack_f32_weight(packed, n), bias)


def round_x_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each block of 32 values of the rows of float ``x [M, K]`` rounded to int8 as
    ``round_x`` does: ``(q int32 [M, K/32, 32], dx [M, K/32], dx * sum(q) [M, K/32])`` with
    ``dx = max|x| / 127`` and ``q = nearest-even(x * (127 / max|x|))`` in float32 (zeros for an
    all-zero block)."""
    xb = x.float().reshape(x.shape[0], -1, quant.BLOCK)
    amax = xb.abs().amax(-1)
    scale = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xb * scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int32)
    dx = amax / 127.0
    return q, dx, dx * q.sum(-1).float()


def _linear_quantized(fmt: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None, round_x: bool) -> torch.Tensor:
    if not round_x:
        y = x.float() @ quant.dequantize(fmt, qweight, scales).t()
        return (y if bias is None else y + bias).to(x.dtype)
    q, dx, xs = round_x_blocks(x)  # [M, KB, 32], [M, KB], [M, KB]
    w = quant.integers(fmt, qweight).to(torch.int32)  # [N, KB, 32]
    d, m = scales[..., 0].float(), scales[..., 1].float()  # [N, KB]
    dots = torch.einsum("mbk,nbk->mnb", q.double(), w.double())  # exact integers
    # block by block, the kernels' sequence: acc = fma(sum, d * dx, acc); acc = fma(m, xs, acc)
    # (each product exact in float64, so only the additions round; elementwise, so a row's
    # result does not depend on the others)
    y = torch.zeros(x.shape[0], qweight.shape[0], dtype=torch.float32, device=x.device)
    for b in range(q.shape[1]):
        scale = d[None, :, b] * dx[:, None, b]
        y = (dots[:, :, b] * scale.double() + y.double()).float()
        y = (m[None, :, b].double() * xs[:, None, b].double() + y.double()).float()
    return (y if bias is None else y + bias).to(x.dtype)


def linear_q4(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None, round_x: bool = False) -> torch.Tensor:
    """``x @ W^T + bias`` for float32 or bfloat16 ``x [M, K]`` and the 4-bit weight ``W [N, K]``
    of :mod:`sgl.kernels.quant` (``qweight`` uint8 ``[N, K/32, 16]``, ``scales`` float16 ``[N,
    K/32, 2]``): the products summed in float32, the result in ``x``'s dtype (rounded once).
    ``bias``: float32 ``[N]``. ``round_x``: ``x`` is first rounded per block of 32 to int8
    (:func:`round_x_blocks`, llama.cpp's ``Q8_0`` activations) and each block's products are
    integers, summed exactly, then block by block in K's order ``acc = fma(sum, d * dx, acc)``
    and ``acc = fma(m, dx * sum(q), acc)`` in float32 from ``acc = 0`` (the kernels' sequence;
    here each addition rounds through float64), plus the bias: a row's result does not depend on
    the other rows, at the cost of ``x``'s rounding (at most ``max|x| / 254`` per value)."""
    return _linear_quantized("q4", x, qweight, scales, bias, round_x)


def linear_q8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None, round_x: bool = False) -> torch.Tensor:
    """:func:`linear_q4` for the 8-bit layout (``qweight`` int8 ``[N, K/32, 32]``)."""
    return _linear_quantized("q8", x, qweight, scales, bias, round_x)


def linear_q6(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              bias: torch.Tensor | None, round_x: bool = False) -> torch.Tensor:
    """:func:`linear_q4` for the 6-bit layout (GGUF's ``Q6_K``; ``qweight`` uint8 ``[N, K/32,
    26]``), not an operator of the contract (kernels multiply it packed, ``linear_qx16``): with
    ``round_x`` each block's integer is ``sum x s (q - 32)`` over its two halves (exact), and
    ``m`` is 0, so the block adds ``fma(sum, d * dx, acc)`` alone."""
    return _linear_quantized("q6", x, qweight, scales, bias, round_x)


def linear_qx16(x: torch.Tensor, packed: torch.Tensor, bits: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear_q4` (``bits`` 4), :func:`linear_q8` (8) or :func:`linear_q6` (6) with
    ``round_x`` for the weight packed in the layout ``q4x16``, ``q8x16`` or ``q6x16``
    (:func:`sgl.kernels.quant.pack_x16`; N a multiple of 16): the same bits."""
    if bits not in (4, 6, 8):
        raise ValueError(f"linear_qx16: bits must be 4, 6 or 8, got {bits}")
    fmt = f"q{bits}"
    qweight, scales = quant.unpack_x16(f"{fmt}x16", packed)
    return _linear_quantized(fmt, x, qweight, scales, bias, True)


#: channels per group and values per step of :func:`pack_int8_weight`'s layout, and the step K
#: is padded to
INT8_GROUP, INT8_STEP, INT8_K_ALIGN = 16, 4, 64


def pack_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of an int8 ``weight [N, K]`` that :func:`linear_w8a8` takes: uint8
    ``[Np/16, Kp/4, 64]`` holding ``w + 128``, for each group of 16 output channels and each 4
    values along K the 4 values of each channel side by side (the B operand of AMX's int8 tiles
    and of ``vpdpbusd``); N padded to a multiple of 16 and K to one of 64 with ``w = 0``."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(f"pack_int8_weight takes an int8 [N, K] weight, got {weight.dtype} "
                         f"{list(weight.shape)}")
    n, k = weight.shape
    np_ = -(-n // INT8_GROUP) * INT8_GROUP
    kp = -(-k // INT8_K_ALIGN) * INT8_K_ALIGN
    padded = torch.zeros((np_, kp), dtype=torch.int16, device=weight.device)
    padded[:n, :k] = weight
    stored = (padded + 128).to(torch.uint8)  # [Np, Kp]
    return stored.view(np_ // INT8_GROUP, INT8_GROUP, kp // INT8_STEP, INT8_STEP) \
        .permute(0, 2, 1, 3).reshape(np_ // INT8_GROUP, kp // INT8_STEP,
                                     INT8_GROUP * INT8_STEP).contiguous()


def unpack_int8_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 ``weight [n, k]`` of :func:`pack_int8_weight`'s ``packed``."""
    groups, steps, _ = packed.shape
    stored = packed.view(groups, steps, INT8_GROUP, INT8_STEP).permute(0, 2, 1, 3) \
        .reshape(groups * INT8_GROUP, steps * INT8_STEP)
    return (stored[:n, :k].to(torch.int16) - 128).to(torch.int8)


def round_x_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of float ``x [M, K]`` rounded to int8 as :func:`linear_w8a8` rounds it:
    ``(q int32 [M, K], sx [M])`` with ``sx = max|x| / 127`` and ``q = nearest-even(x * (127 /
    max|x|))`` in float32, clamped to +-127 (zeros for an all-zero row)."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int32)
    return q, amax / 127.0


def linear_w8a8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W^T + bias`` in SGLang's ``w8a8_int8`` scheme: ``W = scales[n] * w[n, k]`` with int8
    ``w`` (:func:`pack_int8_weight`'s ``packed``) and float32 ``scales [N]``, and each row of
    float32 or bfloat16 ``x [M, K]`` rounded to int8 first (:func:`round_x_rows`, dynamic
    per-token). The integer products are summed exactly, then ``y = float32(sum) * sx * scales[n]``
    (``+ bias[n]``, float32 ``[N]``), rounded once to ``x``'s dtype: a row's result does not
    depend on the other rows, and a kernel computes exactly these numbers."""
    q, sx = round_x_rows(x)
    w = unpack_int8_weight(packed, scales.numel(), x.shape[-1])
    sums = (q.double() @ w.double().t()).to(torch.int32)  # exact integers
    y = sums.float() * sx.unsqueeze(-1) * scales.float()
    return (y if bias is None else y + bias).to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` per row with ``weight [1, width]``: normalised in float32 and
    rounded to ``x``'s dtype before the weight multiplies (transformers' order)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rmsnorm(x + residual), x + residual)``, the sum rounded to ``x``'s dtype first."""
    summed = x + residual
    return rmsnorm(summed, weight, eps), summed


def rmsnorm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  head_dim: int) -> torch.Tensor:
    """:func:`rmsnorm` of every ``head_dim``-wide part of the rows of ``x [T, heads * head_dim]``
    with ``weight [1, head_dim]`` (per-head q/k norms); a new contiguous tensor."""
    return rmsnorm(x.reshape(-1, head_dim), weight, eps).view(x.shape[0], -1)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for ``x [T, 2d]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(x: torch.Tensor, heads: int, head_dim: int, rotary_dim: int, cos_sin: torch.Tensor,
           positions: torch.Tensor | None) -> torch.Tensor:
    """Rotate-half rotary of the first ``heads * head_dim`` columns of ``x [T, ...]`` with the
    rows of ``cos_sin [R, 2 * rotary_dim]`` (``cos | cos`` then ``-sin | sin``, in ``x``'s
    dtype): token t uses row ``positions[t]`` (int64), or row t without ``positions``. The
    first ``rotary_dim`` features of each head turn; the rest are copied. A new contiguous
    tensor, computed in ``x``'s dtype as transformers does."""
    t = x.shape[0]
    rows = cos_sin[:t] if positions is None else cos_sin.index_select(0, positions)
    cos = rows[:, None, :rotary_dim]
    sin = rows[:, None, rotary_dim:2 * rotary_dim]
    heads_x = x[:, :heads * head_dim].reshape(t, heads, head_dim)
    part = heads_x[..., :rotary_dim]
    swapped = part.unflatten(-1, (2, rotary_dim // 2)).flip(-2).flatten(-2)
    out = part * cos + swapped * sin
    if rotary_dim < head_dim:
        out = torch.cat([out, heads_x[..., rotary_dim:]], dim=-1)
    return out.reshape(t, heads * head_dim)


def embedding(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``weight[ids]`` for int64 ``ids [T]``; IndexError for an id outside the table."""
    return F.embedding(ids, weight)


def embedding_q(qweight: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[T]``) of a quantized table ``W [N, K]`` (:mod:`sgl.kernels.quant`,
    the layout told by ``qweight``: uint8 ``[N, K/32, 16]`` is q4, int8 ``[N, K/32, 32]`` q8,
    uint8 ``[N, K/32, 26]`` q6) as ``[T, K]`` in ``dtype``: each value ``d q + m`` (q6: ``d s (q -
    32)``, exact) in float32, rounded to ``dtype`` once. A table in a packed layout
    (``q4x16``/``q8x16``/``q6x16``, uint8 ``[N/16, K/32, 320, 576 or 448]``) comes with an
    empty ``scales``. Only
    the selected rows are dequantized. ValueError naming the argument that is not of this form;
    IndexError for an id outside ``[0, N)``. (Kernels may take float32 and bfloat16 alone, as the
    CPU plugin's does; this takes any floating-point ``dtype``.)"""
    packed = {size: layout for layout, (_, size) in quant.X16_LAYOUTS.items()}
    if (qweight.dim() == 3 and qweight.dtype == torch.uint8 and scales.numel() == 0
            and qweight.shape[2] in packed):  # a packed layout: unpacked, then as below
        qweight, scales = quant.unpack_x16(packed[qweight.shape[2]], qweight)
    if qweight.dim() == 3 and (qweight.dtype, qweight.shape[2]) == (torch.uint8, 16):
        fmt = "q4"
    elif qweight.dim() == 3 and (qweight.dtype, qweight.shape[2]) == (torch.int8, 32):
        fmt = "q8"
    elif qweight.dim() == 3 and (qweight.dtype, qweight.shape[2]) == (torch.uint8, 26):
        fmt = "q6"
    else:
        raise ValueError(f"embedding_q: qweight must be uint8 [N, K/32, 16] (q4), int8 "
                         f"[N, K/32, 32] (q8) or uint8 [N, K/32, 26] (q6), got {qweight.dtype} "
                         f"{list(qweight.shape)}")
    n, blocks = qweight.shape[:2]
    if scales.dtype != torch.float16 or list(scales.shape) != [n, blocks, 2]:
        raise ValueError(f"embedding_q: scales must be float16 [N, K/32, 2] = [{n}, {blocks}, 2], "
                         f"got {scales.dtype} {list(scales.shape)}")
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"embedding_q: ids must be a 1-D int64 tensor, got {ids.dtype} "
                         f"{list(ids.shape)}")
    if not dtype.is_floating_point:
        raise ValueError(f"embedding_q: dtype must be a floating-point dtype, got {dtype}")
    if ids.numel() and ids.device.type != "meta" and bool((ids < 0).any() | (ids >= n).any()):
        raise IndexError(f"embedding_q: token id outside the embedding table of {n} rows")
    rows = quant.dequantize(fmt, qweight.index_select(0, ids), scales.index_select(0, ids))
    return rows.to(dtype)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum of float32 ``logits [B, V]`` (int64 ``[B]``)."""
    return logits.argmax(-1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                     v_pool: torch.Tensor, table: torch.Tensor, rows: torch.Tensor,
                     lens: torch.Tensor, loc: torch.Tensor, num_heads: int, num_kv_heads: int,
                     head_dim: int, scale: float, softcap: float, window: int) -> torch.Tensor:
    """One decode step of paged attention for ``T`` sequences of one new token each.

    Writes the new keys ``k [T, Hk * D]`` and values ``v [T, Hk * Dv]`` into the pools (``[slots,
    Hk, D]`` and ``[slots, Hk, Dv]``, or any contiguous shape of those sizes) at slots ``loc
    [T]``, then attends query ``q [T, Hq * D]`` of token t over the slots ``table[rows[t],
    start:lens[t]]`` (``start``: the last ``window`` positions when ``window > 0``, else 0):
    scores times ``scale``, capped as ``softcap * tanh(s / softcap)`` when ``softcap > 0``,
    softmax in float32. Grouped-query: query head h reads KV head ``h // (Hq / Hk)``. Returns
    ``[T, Hq * Dv]`` in ``q``'s dtype."""
    tokens, v_dim = q.shape[0], v_pool.shape[-1]
    k_slots = k_pool.view(-1, num_kv_heads, head_dim)
    v_slots = v_pool.view(-1, num_kv_heads, v_dim)
    k_slots[loc] = k.reshape(tokens, num_kv_heads, head_dim)
    v_slots[loc] = v.reshape(tokens, num_kv_heads, v_dim)
    group = num_heads // num_kv_heads
    out = q.new_empty(tokens, num_heads * v_dim)
    for t in range(tokens):
        length = int(lens[t])
        start = length - window if 0 < window < length else 0
        slots = table[int(rows[t]), start:length]
        keys = k_slots[slots].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        values = v_slots[slots].float().repeat_interleave(group, dim=1)
        query = q[t, :num_heads * head_dim].float().view(num_heads, head_dim)
        scores = torch.einsum("hd,nhd->hn", query, keys) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        weights = scores.softmax(-1)
        out[t] = torch.einsum("hn,nhd->hd", weights, values).reshape(-1).to(q.dtype)
    return out


def extend_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                     table: torch.Tensor, rows: torch.Tensor, q_starts: torch.Tensor,
                     prefix_lens: torch.Tensor, extend_lens: torch.Tensor, num_heads: int,
                     num_kv_heads: int, head_dim: int, scale: float, softcap: float,
                     window: int, tree_bits: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill attention of ragged sequences on top of cached prefixes, from the paged pools.

    Sequence b has ``prefix_lens[b]`` cached tokens and ``extend_lens[b]`` new ones, whose
    queries are rows ``q_starts[b]`` onwards of ``q [T, Hq * D]``; the keys and values of all of
    them (the new ones already written) are the pool slots ``table[rows[b], :prefix + extend]``.
    New token i (position ``p = prefix + i``) attends positions ``start .. p`` (causal; ``start
    = p - window + 1`` when ``window > 0``, else 0), with ``scale``, ``softcap`` and
    grouped-query heads as in :func:`decode_attention`. With ``tree_bits`` (int32 ``[T]``) the new
    tokens of a sequence may be a token tree of at most 32: the query of row ``r`` sees new token
    ``j < 32`` only where bit ``j`` of ``tree_bits[r]`` is set (its ancestors and itself; -1 for
    every row of a plain causal sequence). Returns ``[T, Hq * Dv]`` in ``q``'s dtype (rows of no
    sequence are zero)."""
    v_dim = v_pool.shape[-1]
    k_slots = k_pool.view(-1, num_kv_heads, head_dim)
    v_slots = v_pool.view(-1, num_kv_heads, v_dim)
    group = num_heads // num_kv_heads
    out = q.new_zeros(q.shape[0], num_heads * v_dim)
    for b in range(rows.shape[0]):
        start, prefix, n = int(q_starts[b]), int(prefix_lens[b]), int(extend_lens[b])
        if n == 0:
            continue
        slots = table[int(rows[b]), :prefix + n]
        keys = k_slots[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)
        values = v_slots[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)
        query = q[start:start + n, :num_heads * head_dim].float()
        query = query.view(n, num_heads, head_dim).transpose(0, 1)  # [Hq, n, D]
        scores = query @ keys.transpose(1, 2) * scale  # [Hq, n, prefix + n]
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        pos = torch.arange(prefix, prefix + n).unsqueeze(1)
        key_pos = torch.arange(prefix + n).unsqueeze(0)
        allowed = key_pos <= pos
        if window > 0:
            allowed &= key_pos > pos - window
        if tree_bits is not None:  # new token j seen where bit j of the query's row is set
            new = torch.arange(min(n, 32))
            seen = (tree_bits[start:start + n, None].long() >> new) & 1
            allowed[:, prefix:prefix + new.numel()] &= seen.bool()
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[start:start + n] = (weights @ values).transpose(0, 1).reshape(n, -1).to(q.dtype)
    return out


#: operator name -> its reference implementation
REFERENCES: dict[str, Callable[..., Any]] = {
    "linear_bf16": linear_bf16, "linear_f32": linear_f32, "linear_q4": linear_q4,
    "linear_q8": linear_q8, "linear_qx16": linear_qx16, "linear_w8a8": linear_w8a8,
    "rmsnorm": rmsnorm,
    "add_rmsnorm": add_rmsnorm, "rmsnorm_heads": rmsnorm_heads, "silu_mul": silu_mul,
    "rotary": rotary, "embedding": embedding, "embedding_q": embedding_q,
    "argmax": argmax,
    "decode_attention": decode_attention, "extend_attention": extend_attention,
}


def _declare() -> torch.library.Library:
    library = torch.library.Library(NAMESPACE, "DEF")
    for name, schema in SCHEMAS.items():
        library.define(schema)
        library.impl(name, REFERENCES[name], "CompositeExplicitAutograd")
    return library


_LIBRARY = _declare()  # kept alive: dropping it would remove the operators
