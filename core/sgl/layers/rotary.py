"""Rotary position embedding (rotate-half / NeoX layout) with the common frequency schemes.

The parameters come from ``config.rope_parameters`` (transformers >= 5) or from
``config.rope_theta`` plus ``config.rope_scaling`` (older configs).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sgl.kernels import cpu

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["SUPPORTED_ROPE_TYPES", "RotaryEmbedding", "rope_inv_freq",
           "rope_parameters"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_parameters(config: PretrainedConfig, *,
                    layer_type: str = "full_attention") -> dict[str, Any]:
    """The rope settings of ``config`` as one dict with at least ``rope_type`` and
    ``rope_theta``, whichever transformers version wrote the config.

    ``layer_type`` picks the entry of per-layer-type settings (Gemma 3:
    ``"sliding_attention"`` or ``"full_attention"``); other configs ignore it."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and "full_attention" in params:
        params = params.get(layer_type) or params["full_attention"]  # per-layer-type form
    if isinstance(params, dict) and params:
        out = dict(params)
    else:
        out = dict(getattr(config, "rope_scaling", None) or {})
    out["rope_type"] = out.get("rope_type", out.get("type")) or "default"
    if out.get("rope_theta") is None:
        out["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return out


def rope_inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim / 2]`` (float32) for ``params`` (see
    :func:`rope_parameters`)."""
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "longrope":
        raise ValueError("rope_type 'longrope' switches between two frequency sets; build it "
                         "with get_rope or sgl.layers.longrope.LongRopeRotaryEmbedding")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are slowed by ``factor``, short ones kept, and the
    band between ``high_freq_factor`` and ``low_freq_factor`` interpolated."""
    factor = float(params["factor"])
    low = float(params.get("low_freq_factor", 1.0))
    high = float(params.get("high_freq_factor", 4.0))
    original = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original / low
    short_wave = wavelen < original / high
    smooth = (original / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(long_wave, inv_freq / factor, interpolated)
    return torch.where(short_wave, inv_freq, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` features of every head of flat ``q``/``k`` tensors."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int,
                 params: dict[str, Any], *, device: torch.device | str | None = None) -> None:
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and at most head_dim {head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        inv_freq = rope_inv_freq(rotary_dim, params)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # float32 cache [max_position, rotary_dim]: cos | sin
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device),
                             persistent=False)
        #: dtype -> (the cos_sin it was built from, :meth:`_full_table`)
        self._full_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    #: (positions, its version, dtype, cos rows, sin rows) of the last :meth:`forward`
    _batch_rows: tuple[Any, ...] | None = None

    def _rows(self, positions: torch.Tensor,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, 1, rotary_dim]`` rows ``cos | cos`` and ``-sin | sin`` for ``positions``, in
        ``dtype`` as transformers rounds them (views of :meth:`_table_rows`)."""
        rows = self._table_rows(positions, dtype)
        dim = self.rotary_dim
        return rows[:, None, :dim], rows[:, None, dim:]

    def _table_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[T, 2 * rotary_dim]``: ``cos | cos | -sin | sin`` per position, in ``dtype``. Every
        layer of a forward pass passes the same ``positions`` tensor, so the rows are gathered
        once per pass and reused."""
        cached = self._batch_rows
        version = -1 if positions.is_inference() else positions._version  # none on those
        if (cached is not None and cached[0] is positions and cached[1] == version
                and cached[2] == dtype):
            return cached[3]
        table = self._full_table(dtype).index_select(0, positions.reshape(-1))
        self._batch_rows = (positions, version, dtype, table)
        return table

    def _full_table(self, dtype: torch.dtype) -> torch.Tensor:
        """``[max_position, 2 * rotary_dim]``: ``cos | cos | -sin | sin`` of every position in
        ``dtype`` (built once per dtype); sgl's rotary kernel reads its rows by position."""
        cached = self._full_tables.get(dtype)
        if cached is not None and cached[0] is self.cos_sin:
            return cached[1]
        half = self.rotary_dim // 2
        cos, sin = self.cos_sin[:, :half], self.cos_sin[:, half:]
        table = torch.cat([cos, cos, -sin, sin], dim=-1).to(dtype)
        self._full_tables[dtype] = (self.cos_sin, table)
        return table

    def _rotate(self, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
        """``x * cos + rotate_half(x) * sin`` on the rotary features of ``x [T, H * head_dim]``
        (a view is fine), in ``x``'s dtype with the operations transformers does, so float32
        results are bit-identical to it."""
        tokens = x.shape[0]
        x = x.view(tokens, -1, self.head_dim)
        dim = self.rotary_dim
        part = x[..., :dim]
        swapped = part.unflatten(-1, (2, dim // 2)).flip(-2).flatten(-2)  # x2 | x1, a copy
        out = part * cos2
        out.add_(swapped.mul_(sin2))
        if dim < self.head_dim:
            out = torch.cat([out, x[..., dim:]], dim=-1)
        return out.view(tokens, -1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, Hq * head_dim]``, ``k [T, Hk * head_dim]`` -> rotated copies, same shapes.

        When ``k`` directly follows ``q`` in memory (both split from one fused qkv output),
        both are rotated in one pass and returned as views of one new tensor."""
        both = _adjacent(q, k)
        if q.device.type == "cpu" and cpu.load() is not None and cpu.fits(q, k):  # sgl's CPU kernel, bit-identical
            # the kernel reads each token's row of the whole table itself, so a forward pass
            # needs no torch op here (the CPU kernel library's decode graphs replay it)
            pos: torch.Tensor | None = positions
            if (positions.dim() == 1 and positions.dtype == torch.int64
                    and positions.is_contiguous() and positions.shape[0] == q.shape[0]):
                table = self._full_table(q.dtype)
            else:
                table, pos = self._table_rows(positions, q.dtype), None
            dim, hd = self.rotary_dim, self.head_dim
            if both is not None:
                out = torch.ops.sgl.rotary(both, both.shape[1] // hd, hd, dim, table, pos)
                return out[:, :q.shape[1]], out[:, q.shape[1]:]
            return (torch.ops.sgl.rotary(q, q.shape[1] // hd, hd, dim, table, pos),
                    torch.ops.sgl.rotary(k, k.shape[1] // hd, hd, dim, table, pos))
        cos2, sin2 = self._rows(positions, q.dtype)
        if both is not None:
            out = self._rotate(both, cos2, sin2)
            return out[:, :q.shape[1]], out[:, q.shape[1]:]
        return self._rotate(q, cos2, sin2), self._rotate(k, cos2, sin2)


def _adjacent(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """One ``[T, q + k]`` view over ``q`` and ``k`` when ``k``'s columns follow ``q``'s in the
    same rows of one buffer; else None."""
    if (q.dim() != 2 or k.dim() != 2 or q.dtype != k.dtype or q.shape[0] != k.shape[0]
            or q.stride() != k.stride() or q.stride(1) != 1
            or k.storage_offset() != q.storage_offset() + q.shape[1]
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()):
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1]), q.stride(), q.storage_offset())
