"""Linear layers that can be split over tensor-parallel ranks.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` that copies this
rank's slice of a full Hugging Face tensor into it, so a model's ``load_weights`` needs no
knowledge of the split. Fused layers (``qkv_proj``, ``gate_up_proj``) take a ``shard_id`` naming
which of the original tensors arrives.

After loading, the runner calls ``process_weights_after_loading()``, which prepares CPU weights
for the kernels' matmuls (:mod:`sgl.layers.packed_linear`); a weight reloaded later needs that
call again. Built inside :func:`sgl.layers.quantized.deferred_weights`, a layer holds its weight
as it arrives: quantized blocks stay quantized and are multiplied by the quantized kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sgl.kernels.library import PackedWeight
from sgl.kernels.quant import BLOCK, CHANNEL_LAYOUT
from sgl.layers.packed_linear import linear, pack_weight
from sgl.layers.quantized import (
    QUANTIZE_MODES,
    QuantizedTensor,
    init_weight,
    pack_channel_weight,
    pack_round_x_weight,
    quantized_linear,
    store_weight_rows,
)
from sgl.layers.tp import divide, get_tp_group, tp_all_gather, tp_all_reduce

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "RowParallelLinear",
]


def _param(shape: tuple[int, ...], dtype: torch.dtype | None,
           device: torch.device | str | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _check_full(loaded: torch.Tensor, rows: int, cols: int | None, what: str) -> None:
    """Validate the unsplit checkpoint tensor (``cols`` None: a bias)."""
    expected = (rows,) if cols is None else (rows, cols)
    if tuple(loaded.shape) != expected:
        raise ValueError(f"{what}: expected shape {expected}, got {tuple(loaded.shape)}")


def _copy(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"{what}: expected shape {tuple(param.shape)}, got {tuple(loaded.shape)}")
    param.copy_(loaded)


Loaded = torch.Tensor | QuantizedTensor


class _ParallelLinear(nn.Module):
    """A weight ``[out, in]`` and optional bias ``[out]`` (this rank's slices), each loaded
    through the layer's ``weight_loader`` and packed for the CPU matmuls after loading. The
    weight may be held quantized (:mod:`sgl.layers.quantized`): then ``weight_layout`` names
    its layout and ``weight_scales`` holds its scales."""

    weight_loader: Callable[..., None]
    weight_layout: str | None
    weight_scales: torch.Tensor | None

    def _make_params(self, out_features: int, in_features: int, *, bias: bool,
                     dtype: torch.dtype | None, device: torch.device | str | None) -> None:
        init_weight(self, out_features, in_features, dtype, device, self.weight_loader)
        if bias:
            self.bias: nn.Parameter | None = _param((out_features,), dtype, device)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        self.packed: PackedWeight | None = None
        self.bias32: torch.Tensor | None = None

    def _in_features(self, param: torch.Tensor) -> int | None:
        return None if param is self.bias else self.weight_shape[1]

    def _store(self, param: torch.Tensor, offset: int, loaded: Loaded, what: str) -> None:
        """Copy ``loaded`` into rows ``offset:`` of the weight, or of the bias if ``param``
        is the bias."""
        if param is self.bias:
            _copy(param.data.narrow(0, offset, loaded.shape[0]), loaded, what)
            return
        store_weight_rows(self, offset, loaded, what,
                          quantize_as=QUANTIZE_MODES.get(self.weight_mode or ""))

    def process_weights_after_loading(self) -> None:
        """Pack the loaded weight for the CPU matmul (see :mod:`sgl.layers.packed_linear`);
        a quantized weight needs no copy, only its bias in float32 (and is reordered in place
        where the kernels take it so: :func:`~sgl.layers.quantized.pack_channel_weight`,
        :func:`~sgl.layers.quantized.pack_round_x_weight`)."""
        if self.weight_layout is not None:
            self.packed = None
            self.bias32 = None if self.bias is None else self.bias.detach().float()
            if self.weight_layout == CHANNEL_LAYOUT:
                pack_channel_weight(self)
            else:
                pack_round_x_weight(self)
        else:
            self.packed = pack_weight(self.weight, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_layout is not None:
            bias32 = None if bias is None else (
                self.bias32 if self.bias32 is not None else bias.float())
            return quantized_linear(x, self.weight_layout, self.weight, self.weight_scales,
                                    bias32, round_x=self.round_x)
        return linear(x, self.weight, bias, self.packed)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the output features split over ranks (rank r holds rows
    ``[r * out / tp, (r + 1) * out / tp)`` of ``W``)."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False,
                 gather_output: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = divide(output_size, self.tp.size, "output size")
        self.gather_output = gather_output
        per_rank = self.output_size_per_partition
        self._make_params(per_rank, input_size, bias=bias, dtype=dtype, device=device)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        _check_full(loaded, self.output_size, self._in_features(param), "column-parallel linear")
        size = self.output_size_per_partition
        self._store(param, 0, loaded.narrow(0, self.tp.rank * size, size), "column-parallel linear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x, self.bias)
        return tp_all_gather(out, dim=-1) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (``gate_up_proj``); ``shard_id`` is the index into ``output_sizes``."""

    def __init__(self, input_size: int, output_sizes: list[int], *, bias: bool = False,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, dtype=dtype, device=device)
        for size in self.output_sizes:
            divide(size, self.tp.size, "fused output size")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard_id must be one of {list(range(len(self.output_sizes)))}, got {shard_id!r}"
            )
        _check_full(loaded, self.output_sizes[shard_id], self._in_features(param),
                    f"fused shard {shard_id}")
        size = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        self._store(param, offset, loaded.narrow(0, self.tp.rank * size, size),
                    f"fused shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections fused, split by heads; ``shard_id`` is ``"q"``, ``"k"`` or
    ``"v"``. With fewer key/value heads than ranks, key/value heads are replicated."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, *, bias: bool = False,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        tp = get_tp_group()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, tp.size, "number of attention heads")
        if total_num_kv_heads >= tp.size:
            self.num_kv_heads = divide(total_num_kv_heads, tp.size, "number of key/value heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp.size, total_num_kv_heads, "tensor-parallel size")
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden_size, output_size, bias=bias, dtype=dtype, device=device)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp.rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp.rank // self.kv_replicas
        else:
            raise ValueError(f"shard_id must be one of 'q', 'k', 'v', got {shard_id!r}")
        heads = self.num_heads * self.tp.size if shard_id == "q" else (
            self.num_kv_heads * self.tp.size // self.kv_replicas)
        _check_full(loaded, heads * self.head_dim, self._in_features(param), f"{shard_id}_proj")
        self._store(param, offset, loaded.narrow(0, rank * size, size), f"{shard_id}_proj")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, q + 2 kv] -> q [T, q], k [T, kv], v [T, kv]`` (views)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q, k, v


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the input features split over ranks; the partial products are
    summed across ranks, then the (unsplit) bias is added once."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = divide(input_size, self.tp.size, "input size")
        self._make_params(output_size, self.input_size_per_partition, bias=bias, dtype=dtype,
                          device=device)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if param is self.bias:  # not split
            _copy(param.data, loaded, "row-parallel bias")
            return
        _check_full(loaded, self.output_size, self.input_size, "row-parallel linear")
        size = self.input_size_per_partition
        start = self.tp.rank * size
        if isinstance(loaded, QuantizedTensor) and loaded.layout != CHANNEL_LAYOUT and (
                start % BLOCK or size % BLOCK):
            loaded = loaded.dequantize(self.weight_dtype)  # this split cuts through blocks
        part = loaded.narrow(1, start, size) if self.tp.size > 1 else loaded
        self._store(param, 0, part, "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._matmul(x, self.bias)
        out = tp_all_reduce(self._matmul(x, None))
        return out + self.bias if self.bias is not None else out
