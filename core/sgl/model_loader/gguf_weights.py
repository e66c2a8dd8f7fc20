"""Weights of a GGUF file, renamed to Hugging Face names: dequantized tensor by tensor, or,
with ``quantized=True``, the blocks of the types in :data:`GGUF_QUANTIZED` repacked into a
:class:`~sgl.layers.quantized.QuantizedTensor` (the others dequantized, and logged).

llama.cpp stores tensor shapes innermost-first (reversed against torch) and, for the
``llama`` architecture, permutes the rows of ``attn_q``/``attn_k`` so that rotary pairs are
interleaved; that permutation is undone here so the weights work with the usual rotate-half
rotary embedding (it moves whole rows, so quantized blocks move with them).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader.errors import ModelLoadError
from sgl.model_loader.gguf_kquants import KQUANT_LAYOUTS, repack_kquant_blocks
from sgl.model_loader.source import WeightSource

__all__ = ["GGUF_QUANTIZED", "GGUFWeights", "gguf_to_hf_name", "repack_gguf_blocks",
           "unpermute_rotary_rows"]

logger = logging.getLogger(__name__)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# tensors llama.cpp derives from the config; Hugging Face models recompute them
_SKIPPED = frozenset({"rope_freqs.weight"})
# architectures whose q/k rows llama.cpp's converter permuted
_PERMUTED_ARCHS = frozenset({"llama"})

_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_GLOBAL_TENSOR = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    match = _LAYER_TENSOR.match(name)
    if match:
        layer, kind, suffix = match.groups()
        hf = _LAYER_NAMES.get(kind)
        return None if hf is None else f"model.layers.{layer}.{hf}.{suffix}"
    match = _GLOBAL_TENSOR.match(name)
    if match:
        hf = _GLOBAL_NAMES.get(match.group(1))
        return None if hf is None else f"{hf}.{match.group(2)}"
    return None


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


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


class GGUFWeights(WeightSource):
    """Streams the tensors of a ``.gguf`` file via a memory-mapped ``gguf.GGUFReader``;
    ``quantized``: 2-D tensors of the types in :data:`GGUF_QUANTIZED` come as
    :class:`~sgl.layers.quantized.QuantizedTensor`."""

    def __init__(self, path: Path, dtype: torch.dtype, *, quantized: bool = False) -> None:
        super().__init__(path, dtype)
        self.quantized = quantized
        import gguf

        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # ValueError (bad magic), struct errors, OSError
            raise ModelLoadError(
                f"cannot read GGUF file {str(path)!r} (corrupt or not GGUF): {exc}"
            ) from exc
        self.arch = str(_field(self.reader, "general.architecture") or "")
        self.num_heads = _field(self.reader, f"{self.arch}.attention.head_count")
        self.num_kv_heads = _field(self.reader, f"{self.arch}.attention.head_count_kv")
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        self.tensors = [t for t in self.reader.tensors if t.name not in _SKIPPED]
        unknown = [t.name for t in self.tensors if gguf_to_hf_name(t.name) is None]
        if unknown:
            raise ModelLoadError(
                f"GGUF file {str(path)!r} (architecture {self.arch!r}) has tensors sgl cannot "
                f"map to Hugging Face names: {', '.join(unknown[:5])}; supported GGUF tensors: "
                f"{', '.join(sorted(_GLOBAL_NAMES) + sorted('blk.N.' + k for k in _LAYER_NAMES))}"
            )

        if quantized:
            self._log_dequantized()

    def __len__(self) -> int:
        return len(self.tensors)

    def _keeps_blocks(self, tensor: Any) -> bool:
        return (self.quantized and tensor.tensor_type.name in GGUF_QUANTIZED
                and len(tensor.shape) == 2)

    def _log_dequantized(self) -> None:
        """Say which block types will be dequantized although quantized serving was asked for."""
        dense = Counter(t.tensor_type.name for t in self.tensors
                        if not self._keeps_blocks(t) and len(t.shape) == 2
                        and t.tensor_type.name not in ("F32", "F16", "BF16"))
        if dense:
            logger.warning(
                "%s: %s dequantized to %s at load (sgl runs %s blocks quantized, not these)",
                self.path.name, ", ".join(f"{n} {kind} tensor(s)" for kind, n in sorted(
                    dense.items())), str(self.dtype).removeprefix("torch."),
                "/".join(GGUF_QUANTIZED))

    @property
    def layouts(self) -> Counter[str]:
        """How many tensors come in each form: ``q4``, ``q8`` or ``dense``."""
        return Counter(GGUF_QUANTIZED[t.tensor_type.name] if self._keeps_blocks(t) else "dense"
                       for t in self.tensors)

    def _rotary_heads(self, hf_name: str) -> int | None:
        if self.arch not in _PERMUTED_ARCHS:
            return None
        if ".self_attn.q_proj." in hf_name:
            return int(self.num_heads)
        if ".self_attn.k_proj." in hf_name:
            return int(self.num_kv_heads)
        return None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        from gguf.quants import dequantize

        for tensor in self.tensors:
            hf_name = gguf_to_hf_name(tensor.name)
            if hf_name is None:  # checked in __init__
                raise ModelLoadError(f"unmapped GGUF tensor {tensor.name!r}")
            heads = self._rotary_heads(hf_name)
            if self._keeps_blocks(tensor):
                cols, rows = (int(d) for d in tensor.shape.tolist())
                blocks = QuantizedTensor(*repack_gguf_blocks(tensor.tensor_type.name,
                                                             tensor.data, rows, cols))
                if heads is not None:
                    blocks = blocks.map_rows(lambda t, h=heads: unpermute_rotary_rows(t, h))
                yield hf_name, blocks
                continue
            try:
                array = dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError as exc:
                raise ModelLoadError(
                    f"GGUF tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, "
                    f"which gguf {_gguf_version()} cannot dequantize: {exc}"
                ) from exc
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            weight = torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).reshape(shape)
            if heads is not None:
                weight = unpermute_rotary_rows(weight, heads)
            yield hf_name, self._cast(weight)


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "(unknown version)"
