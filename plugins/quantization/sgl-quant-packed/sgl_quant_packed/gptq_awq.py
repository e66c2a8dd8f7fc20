"""Weights of GPTQ and AWQ checkpoints in their own formats (what AutoGPTQ/GPTQModel and AutoAWQ
write, and vLLM and SGLang serve as ``--quantization gptq`` / ``awq``), chosen by
``quantization_config.quant_method`` in ``config.json``.

**GPTQ** (``quant_method: gptq``): a quantized linear layer ``x`` (weight ``[N, K]``) arrives as

* ``x.qweight``: int32 ``[K * bits / 32, N]``, packed along the input dimension: value ``k``
  at bits ``(k % (32 / bits)) * bits`` of word ``k // (32 / bits)``;
* ``x.qzeros``: int32 ``[G, N * bits / 32]``, the zero points packed the same way along N;
* ``x.scales``: float16 ``[G, N]``;
* ``x.g_idx`` (optional): int32 ``[K]``, the group of each input column;
* ``x.bias`` (optional), read as it is.

``W[n, k] = (q[k, n] - z[g(k), n]) * scales[g(k), n]`` with ``g(k) = k // group_size`` (one
group when ``group_size`` is -1). ``checkpoint_format: gptq`` (v1, the default) stores
``z - 1`` (modulo ``2^bits``: a zero of 0 is stored as ``2^bits - 1``), ``gptq_v2`` stores
``z``. ``sym`` needs nothing of its own: the zeros say it. Bits 4 and 8; ``desc_act: true``
loads when ``g_idx`` is the trivial ``k // group_size`` (static groups), and a layer with any
other ``g_idx`` (act-order groups) is refused with its name.

**AWQ** (``quant_method: awq``, AutoAWQ's ``version: gemm``, 4 bits):

* ``x.qweight``: int32 ``[K, N / 8]``, packed along the output dimension with AutoAWQ's
  interleaving: nibble ``j`` (bits ``4j``) of word ``w`` holds column
  ``8w + [0, 2, 4, 6, 1, 3, 5, 7][j]`` (so column ``8w + i`` is in nibble
  ``[0, 4, 1, 5, 2, 6, 3, 7][i]``);
* ``x.qzeros``: int32 ``[G, N / 8]``, packed the same way; ``x.scales``: float16 ``[G, N]``.

``W = (q - z) * s`` per group of ``group_size`` input columns. With ``zero_point: false`` the
zero is 8 (``W = (q - 8) s``) and qzeros are not read, as compressed-tensors' AutoAWQ converter
and vLLM's CPU kernel take it. The other versions (``gemv``, ``gemv_fast``, ``marlin``,
``exllama``, ``ipex``) pack otherwise and are refused.

In both, layers the checkpoint leaves dense (AWQ's ``modules_to_not_convert``, GPTQ's modules
outside ``modules_in_block_to_quantize``, the embedding, usually the LM head) come as
``x.weight`` and are read as they are.

:class:`GPTQAWQWeights` yields ``x.weight`` instead of the parts, through
:func:`sgl_quant_packed.packed.grouped_weight`: ``q4`` blocks (``q`` as it is, ``d = scale``,
``m = -z * scale``) or ``q8`` blocks (``q - 128``, ``m = -(z - 128) * scale``) where the groups
are whole blocks of 32, else (or when asked for dense tensors) dequantized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader.errors import ModelLoadError
from sgl_quant_packed.packed import PackedWeights, grouped_weight, unpack_rows

__all__ = ["AWQ", "GPTQ", "GPTQAWQWeights", "check_gptq_awq"]

#: ``quantization_config.quant_method`` of the two kinds of checkpoint
GPTQ, AWQ = "gptq", "awq"
#: the GPTQ ``checkpoint_format`` values read: v1 (zeros stored minus one) and v2
GPTQ_FORMATS = ("gptq", "gptq_v2")
#: the position, in its word, of each of 8 consecutive columns of an AWQ tensor
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]
#: the group size when a config names none (AutoGPTQ's and AutoAWQ's default)
DEFAULT_GROUP = 128


def _method(quant: dict[str, Any]) -> str:
    return str(quant.get("quant_method", "")).lower()


def _bits(quant: dict[str, Any]) -> Any:
    return quant.get("bits", quant.get("w_bit", 4))  # AutoAWQ's own quant_config.json: w_bit


def _group_size(quant: dict[str, Any]) -> Any:
    return quant.get("group_size", quant.get("q_group_size", DEFAULT_GROUP))


def _gptq_format(quant: dict[str, Any]) -> str:
    if quant.get("is_marlin_format"):  # what older AutoGPTQ wrote for Marlin repacks
        return "marlin"
    return str(quant.get("checkpoint_format") or "gptq").lower()


def check_gptq_awq(quant: dict[str, Any], name: str) -> None:
    """ValueError naming what sgl cannot run in the GPTQ or AWQ checkpoint ``name``: anything
    but 4-/8-bit GPTQ in the v1 or v2 format and 4-bit AWQ of the GEMM version, with one group
    size (or -1) for every layer."""
    method, bits = _method(quant), _bits(quant)
    if method == GPTQ:
        if bits not in (4, 8):
            raise ValueError(f"{name} is a GPTQ checkpoint of {bits}-bit weights; sgl runs 4- "
                             "and 8-bit GPTQ checkpoints (2- and 3-bit ones are not supported)")
        fmt = _gptq_format(quant)
        if fmt not in GPTQ_FORMATS:
            raise ValueError(f"{name} is a GPTQ checkpoint in the {fmt!r} format; sgl reads "
                             f"the {' and '.join(GPTQ_FORMATS)} formats")
        if quant.get("dynamic"):
            raise ValueError(f"{name} is a GPTQ checkpoint with per-module overrides "
                             "(dynamic); sgl runs one bit width and group size for every layer")
    elif method == AWQ:
        version = str(quant.get("version") or "gemm").lower()
        if version != "gemm":
            raise ValueError(f"{name} is an AWQ checkpoint of version {version!r}; sgl runs "
                             "AutoAWQ's gemm version (gemv, gemv_fast, marlin, exllama and ipex "
                             "pack their integers otherwise)")
        if bits != 4:
            raise ValueError(f"{name} is an AWQ checkpoint of {bits}-bit weights; sgl runs "
                             "4-bit AWQ checkpoints")
    else:
        raise ValueError(f"{name} is neither a GPTQ nor an AWQ checkpoint ({method or 'none'})")
    group = _group_size(quant)
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise ValueError(f"{name} has group_size {group!r}; expected -1 or a positive integer")


class GPTQAWQWeights(PackedWeights):
    """The tensors of a GPTQ or AWQ folder (``quant``: its ``quantization_config``), each
    quantized layer's parts as one ``weight``: :class:`~sgl.layers.quantized.QuantizedTensor`
    blocks when ``quantized``, else dense (see the module docstring)."""

    PARTS = ("qweight", "qzeros", "scales", "g_idx")

    def __init__(self, path: Path, dtype: torch.dtype, quant: dict[str, Any], *,
                 quantized: bool) -> None:
        try:
            check_gptq_awq(quant, path.name)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
        super().__init__(path, dtype, quantized=quantized)
        self.awq = _method(quant) == AWQ
        self.bits = int(_bits(quant))
        self.group_size = int(_group_size(quant))
        #: GPTQ v1 stores each zero minus one
        self.zeros_minus_one = not self.awq and _gptq_format(quant) == "gptq"
        #: AWQ without zero points: every zero is 8
        self.zero_point = not self.awq or bool(quant.get("zero_point", True))

    def _weight(self, prefix: str,
                parts: dict[str, torch.Tensor]) -> QuantizedTensor | torch.Tensor:
        qweight, scales = parts["qweight"], parts.get("scales")
        if scales is None:
            raise ModelLoadError(f"{prefix}: qweight without scales")
        if qweight.dtype != torch.int32 or qweight.dim() != 2 or scales.dim() != 2:
            raise ModelLoadError(f"{prefix}: qweight {qweight.dtype} {list(qweight.shape)} and "
                                 f"scales {list(scales.shape)} are not a packed int32 weight "
                                 "with 2-D scales")
        per_word = 32 // self.bits
        if self.awq:  # [K, N / 8], the columns interleaved
            cols, rows = qweight.shape[0], qweight.shape[1] * per_word
            q = awq_columns(unpack_rows(qweight, self.bits, rows)).t()
        else:  # [K * bits / 32, N]
            cols, rows = qweight.shape[0] * per_word, qweight.shape[1]
            q = unpack_rows(qweight.t(), self.bits, cols)
        group = self._group(prefix, cols)
        groups = cols // group
        if list(scales.shape) != [groups, rows]:
            raise ModelLoadError(f"{prefix}: scales {list(scales.shape)} are not [{groups}, "
                                 f"{rows}] (groups of {group} columns of the [{rows}, {cols}] "
                                 "weight)")
        if "g_idx" in parts:
            check_g_idx(prefix, parts["g_idx"], group)
        zero = self._zeros(prefix, parts.get("qzeros"), groups, rows)
        return grouped_weight(prefix, q, scales.t(), zero.t(), self.bits,
                              quantized=self.quantized)

    def _group(self, prefix: str, cols: int) -> int:
        group = cols if self.group_size == -1 or self.group_size >= cols else self.group_size
        if cols % group:
            raise ModelLoadError(f"{prefix}: its {cols} input columns are not whole groups of "
                                 f"{group}")
        return group

    def _zeros(self, prefix: str, qzeros: torch.Tensor | None, groups: int,
               rows: int) -> torch.Tensor:
        """The zero points ``[G, N]`` as float32."""
        if not self.zero_point:
            return torch.full((groups, rows), 8.0)
        shape = [groups, rows * self.bits // 32]
        if qzeros is None or qzeros.dtype != torch.int32 or list(qzeros.shape) != shape:
            got = "none" if qzeros is None else f"{qzeros.dtype} {list(qzeros.shape)}"
            raise ModelLoadError(f"{prefix}: qzeros must be int32 {shape}, got {got}")
        zeros = unpack_rows(qzeros, self.bits, rows)
        if self.awq:
            zeros = awq_columns(zeros)
        zeros = zeros.to(torch.int16)
        if self.zeros_minus_one:
            zeros = (zeros + 1) & ((1 << self.bits) - 1)
        return zeros.float()


def awq_columns(values: torch.Tensor) -> torch.Tensor:
    """The values ``[R, N]`` unpacked from an AWQ tensor (word by word, nibble by nibble) in the
    order of their columns."""
    rows, cols = values.shape
    return values.view(rows, cols // 8, 8)[:, :, AWQ_REVERSE_ORDER].reshape(rows, cols)


def check_g_idx(prefix: str, g_idx: torch.Tensor, group: int) -> None:
    """ModelLoadError unless every input column ``k`` of the layer ``prefix`` is in group
    ``k // group`` (what ``desc_act`` with static groups, and every checkpoint without
    ``desc_act``, stores)."""
    trivial = torch.arange(g_idx.numel()) // group
    if g_idx.dim() != 1 or not torch.equal(g_idx.long(), trivial):
        raise ModelLoadError(f"{prefix}: act-order groups are not supported (its g_idx puts "
                             f"input columns in other groups than k // {group}; sgl runs GPTQ "
                             "checkpoints whose groups are runs of consecutive columns, e.g. "
                             "desc_act with static_groups)")
