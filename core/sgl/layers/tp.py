"""Tensor-parallel state seen by the layers: this rank, the group size and the collectives.

World size is 1 unless a parallel strategy calls :func:`set_tp_group` in each worker before the
model is built; with size 1 the collectives are no-ops, so nothing here needs
``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TPGroup", "divide", "get_tp_group", "set_tp_group", "tp_all_gather", "tp_all_reduce",
           "tp_min"]


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    process_group: Any = None  # a torch.distributed ProcessGroup when size > 1
    #: faster collectives than the process group's, where the strategy has them (ranks on one
    #: machine: shared memory): ``all_reduce(tensor) -> tensor`` (in place) and
    #: ``all_gather(tensor, dim) -> tensor``, each returning None for a tensor it does not take
    fast: Any = None


_current = TPGroup()


def get_tp_group() -> TPGroup:
    return _current


def set_tp_group(group: TPGroup) -> None:
    """Set this process's tensor-parallel rank and group (before building the model)."""
    global _current
    if not 0 <= group.rank < group.size:
        raise ValueError(f"tensor-parallel rank {group.rank} is outside [0, {group.size})")
    _current = group


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator``, or a clear error when the split is uneven."""
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size {denominator} "
            "(--tp-size); choose a size that divides it"
        )
    return numerator // denominator


def tp_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the tensor-parallel group (in place when size > 1)."""
    group = get_tp_group()
    if group.size == 1:
        return tensor
    if group.fast is not None and group.fast.all_reduce(tensor) is not None:
        return tensor
    import torch.distributed as dist

    dist.all_reduce(tensor, group=group.process_group)
    return tensor


def tp_all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in rank order."""
    group = get_tp_group()
    if group.size == 1:
        return tensor
    if group.fast is not None:
        gathered = group.fast.all_gather(tensor, dim)
        if gathered is not None:
            return gathered
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(group.size)]
    dist.all_gather(parts, tensor.contiguous(), group=group.process_group)
    return torch.cat(parts, dim=dim)


def tp_min(value: int) -> int:
    """The smallest of every rank's ``value`` (what all ranks can agree to, e.g. a pool size)."""
    group = get_tp_group()
    if group.size == 1:
        return value
    import torch.distributed as dist

    # NCCL reduces only CUDA tensors
    device = "cuda" if dist.get_backend(group.process_group) == "nccl" else "cpu"
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=group.process_group)
    return int(tensor.item())
