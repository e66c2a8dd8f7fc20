"""Weights of a GGUF file, renamed to Hugging Face names: dequantized tensor by tensor, or,
with ``quantized=True``, the blocks of the types in :data:`GGUF_QUANTIZED` repacked into a
:class:`~sgl.layers.quantized.QuantizedTensor` (the others dequantized, and logged).

llama.cpp stores tensor shapes innermost-first (reversed against torch). What its converter did
to the Hugging Face tensors depends on the architecture (a
:class:`~sgl.model_loader.gguf_archs.GGUFArch` a model plugin registered) and is undone here:
q/k rows permuted so that rotary pairs are interleaved are put back for the usual rotate-half
rotary embedding; norm weights lose what the converter added; fused tensors are split by rows
and stacked experts into one tensor per expert. All of these move or cut whole rows, so
quantized blocks go through them unchanged.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader.errors import ModelLoadError
from sgl.model_loader.gguf_archs import GGUFArch, Piece, gguf_arch, installed_gguf_archs
from sgl.model_loader.gguf_config import GGUFMetadata, read_gguf
from sgl.model_loader.gguf_kquants import KQUANT_LAYOUTS, repack_kquant_blocks
from sgl.model_loader.source import WeightSource

__all__ = ["GGUF_QUANTIZED", "GGUFWeights", "gguf_to_hf_name", "repack_gguf_blocks",
           "unpermute_rotary_rows"]

logger = logging.getLogger(__name__)


def gguf_to_hf_name(name: str, arch: str,
                    gguf_archs: Mapping[str, GGUFArch] | None = None) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` for GGUF
    architecture ``arch`` (of ``gguf_archs``, default the installed plugins'); None if unknown,
    or if the tensor holds several Hugging Face tensors (a fused or stacked one) or none
    (``rope_freqs``)."""
    rules = (installed_gguf_archs() if gguf_archs is None else gguf_archs).get(arch)
    return None if rules is None else rules.hf_name(name)


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleaving of a q/k projection (weight or bias)."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot un-permute {rows} rows over {num_heads} heads")
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape)


#: GGUF block types whose blocks map onto a quantized layout of :mod:`sgl.kernels.quant`
GGUF_QUANTIZED = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8", **KQUANT_LAYOUTS}


def repack_gguf_blocks(type_name: str, data: np.ndarray, rows: int,
                       cols: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    """``(layout, qweight, scales)`` of a GGUF tensor of block type ``type_name`` (a key of
    :data:`GGUF_QUANTIZED`) with ``rows`` x ``cols`` values, from its raw bytes ``data``.

    The blocks are those of llama.cpp: ``Q4_0`` is float16 ``d`` and 16 bytes of nibbles (``W =
    d (q - 8)``), ``Q4_1`` float16 ``d``, ``m`` and the nibbles (``W = d q + m``), ``Q8_0``
    float16 ``d`` and 32 int8 (``W = d q``). The nibbles and int8 keep their byte order; only
    the scales move into their own tensor (``Q4_0``'s offset becomes ``m = -8 d``, exactly).
    The K-quants (``Q4_K``, ``Q5_K``, ``Q6_K``) are repacked by
    :func:`~sgl.model_loader.gguf_kquants.repack_kquant_blocks`, with the rounding it states."""
    layout = GGUF_QUANTIZED.get(type_name)
    if layout is None:
        raise ValueError(f"GGUF block type {type_name} has no quantized layout here "
                         f"(those that do: {', '.join(GGUF_QUANTIZED)})")
    if type_name in KQUANT_LAYOUTS:
        return repack_kquant_blocks(type_name, data, rows, cols)
    if cols % 32:
        raise ValueError(f"a {type_name} tensor's rows must hold whole 32-value blocks, "
                         f"got {cols} values")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(rows, cols // 32, -1)
    d = blocks[..., 0:2].copy().view(np.float16)
    if type_name == "Q4_0":
        m, qs = d * np.float16(-8), blocks[..., 2:18]
    elif type_name == "Q4_1":
        m, qs = blocks[..., 2:4].copy().view(np.float16), blocks[..., 4:20]
    else:
        m, qs = np.zeros_like(d), blocks[..., 2:34].view(np.int8)
    qweight = torch.from_numpy(np.ascontiguousarray(qs))
    scales = torch.from_numpy(np.concatenate([d, m], axis=-1))
    return layout, qweight, scales


class GGUFWeights(WeightSource):
    """Streams the tensors of a ``.gguf`` file via a memory-mapped ``gguf.GGUFReader``;
    ``quantized``: 2-D tensors (and stacked experts) of the types in :data:`GGUF_QUANTIZED`
    come as :class:`~sgl.layers.quantized.QuantizedTensor`. ``gguf_archs``: the architectures
    the plugins registered (None: the installed plugins').

    :raises ModelLoadError: for a file that is not GGUF, an architecture sgl does not load
        (the message lists those it does) or a tensor it cannot name."""

    def __init__(self, path: Path, dtype: torch.dtype, *, quantized: bool = False,
                 gguf_archs: Mapping[str, GGUFArch] | None = None) -> None:
        super().__init__(path, dtype)
        self.quantized = quantized
        self.reader = read_gguf(path)
        meta = GGUFMetadata(self.reader)
        self.arch = meta.arch
        archs = installed_gguf_archs() if gguf_archs is None else gguf_archs
        self.rules: GGUFArch = gguf_arch(self.arch, archs, path)
        self.num_heads = int(meta.arch_get("attention.head_count") or 0)
        self.num_kv_heads = int(meta.arch_get("attention.head_count_kv") or self.num_heads)
        #: each tensor of the file with the Hugging Face tensors it holds (none: config only)
        self.plan: list[tuple[Any, list[Piece]]] = []
        unknown = []
        for tensor in self.reader.tensors:
            pieces = self.rules.pieces(tensor.name, self._shape(tensor), self.num_heads,
                                       self.num_kv_heads)
            if pieces is None:
                unknown.append(tensor.name)
            elif pieces:
                self.plan.append((tensor, pieces))
        if unknown:
            raise ModelLoadError(
                f"GGUF file {str(path)!r} (architecture {self.arch!r}) has tensors sgl cannot "
                f"map to Hugging Face names: {', '.join(unknown[:5])}; supported GGUF tensors of "
                f"{self.arch}: {', '.join(self.rules.kinds())}"
            )
        self.tensors = [tensor for tensor, _ in self.plan]

        if quantized:
            self._log_dequantized()

    @staticmethod
    def _shape(tensor: Any) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(tensor.shape.tolist()))

    def __len__(self) -> int:
        return sum(len(pieces) for _, pieces in self.plan)

    def _keeps_blocks(self, tensor: Any) -> bool:
        return (self.quantized and tensor.tensor_type.name in GGUF_QUANTIZED
                and len(tensor.shape) in (2, 3))

    def _log_dequantized(self) -> None:
        """Say which block types will be dequantized although quantized serving was asked for."""
        dense = Counter(t.tensor_type.name for t in self.tensors
                        if not self._keeps_blocks(t) and len(t.shape) >= 2
                        and t.tensor_type.name not in ("F32", "F16", "BF16"))
        if dense:
            logger.warning(
                "%s: %s dequantized to %s at load (sgl runs %s blocks quantized, not these)",
                self.path.name, ", ".join(f"{n} {kind} tensor(s)" for kind, n in sorted(
                    dense.items())), str(self.dtype).removeprefix("torch."),
                "/".join(GGUF_QUANTIZED))

    @property
    def layouts(self) -> Counter[str]:
        """How many tensors of the file come in each form: ``q4``, ``q8``, ``q6`` or
        ``dense``."""
        return Counter(GGUF_QUANTIZED[t.tensor_type.name] if self._keeps_blocks(t) else "dense"
                       for t in self.tensors)

    def _rotary_heads(self, hf_name: str) -> int | None:
        if not self.rules.permuted_qk:
            return None
        if ".self_attn.q_proj." in hf_name:
            return self.num_heads
        if ".self_attn.k_proj." in hf_name:
            return self.num_kv_heads
        return None

    def _read(self, tensor: Any) -> torch.Tensor | QuantizedTensor:
        """The whole tensor: as blocks, or dequantized to float32; 3-D tensors as 2-D rows."""
        shape = self._shape(tensor)
        if self._keeps_blocks(tensor):
            rows = int(np.prod(shape[:-1]))
            return QuantizedTensor(*repack_gguf_blocks(tensor.tensor_type.name, tensor.data,
                                                       rows, shape[-1]))
        from gguf.quants import dequantize

        try:
            array = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, "
                f"which gguf {_gguf_version()} cannot dequantize: {exc}"
            ) from exc
        weight = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(shape)
        return weight.reshape(-1, shape[-1]) if len(shape) > 2 else weight

    def _restore(self, hf_name: str,
                 piece: torch.Tensor | QuantizedTensor) -> torch.Tensor | QuantizedTensor:
        """Undo the converter's transforms of one Hugging Face tensor."""
        heads = self._rotary_heads(hf_name)
        if isinstance(piece, QuantizedTensor):
            if heads is not None:
                piece = piece.map_rows(lambda t, h=heads: unpermute_rotary_rows(t, h))
            return piece
        if heads is not None:
            piece = unpermute_rotary_rows(piece, heads)
        if self.rules.norm_shift and hf_name.endswith("norm.weight"):
            piece = piece - self.rules.norm_shift
        if piece.dim() == 1 and hf_name.rpartition(".")[0].split(".", 3)[-1] in \
                self.rules.row_vectors:
            piece = piece.reshape(1, -1)
        return self._cast(piece)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        for tensor, pieces in self.plan:
            whole = self._read(tensor)
            for hf_name, start, rows in pieces:
                piece = whole if len(pieces) == 1 else whole.narrow(0, start, rows)
                yield hf_name, self._restore(hf_name, piece)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"
