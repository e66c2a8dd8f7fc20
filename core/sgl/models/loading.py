"""Filling a model's parameters from checkpoint tensors its ``load_weights`` has mapped.

A model family turns each Hugging Face tensor into a :class:`MappedWeight` (renaming, splitting
fused tensors, dropping what it does not use); :func:`load_mapped_weights` copies them through
each parameter's ``weight_loader`` and checks that nothing was left unfilled: every shard of a
fused projection and every expert of a :class:`~sgl.layers.FusedMoE` this rank holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl.layers import FusedMoE, MergedColumnParallelLinear, QKVParallelLinear
from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader.errors import ModelLoadError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MappedWeight", "load_mapped_weights", "map_fused_name"]

# Hugging Face projection -> (fused parameter, shard id)
_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# per-expert projection -> (stacked FusedMoE parameter, shard id)
_EXPERT = {
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", "down"),
}

# what one loaded tensor filled: (shard id, expert id)
_Key = tuple["int | str | None", "int | None"]


class MappedWeight(NamedTuple):
    """One checkpoint tensor and the parameter (shard, expert) it fills."""

    source: str  # the checkpoint's name, for error messages
    target: str  # the parameter's name in the model
    shard: int | str | None
    tensor: torch.Tensor | QuantizedTensor
    expert: int | None = None


def _expected(model: nn.Module) -> dict[str, set[_Key]]:
    """Every parameter (a tied one under its owner's name) -> the loads that must fill it."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    expected: dict[str, set[_Key]] = {}
    for prefix, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            name = canonical.get(id(param))
            if name != (f"{prefix}.{local}" if prefix else local):
                continue
            if isinstance(module, FusedMoE):
                shards: tuple[int | str, ...] = ("down",) if local == "down_proj" else (
                    "gate", "up")
                expected[name] = {(s, e) for s in shards for e in module.local_expert_ids}
            elif isinstance(module, QKVParallelLinear):
                expected[name] = {(s, None) for s in ("q", "k", "v")}
            elif isinstance(module, MergedColumnParallelLinear):
                expected[name] = {(i, None) for i in range(len(module.output_sizes))}
            else:
                expected[name] = {(None, None)}
    return expected


def _describe(name: str, absent: set[_Key]) -> str:
    if absent == {(None, None)}:
        return name
    keys = sorted(str(s) if e is None else f"{s} of expert {e}" for s, e in absent)
    more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
    return f"{name} (shards {keys[:4]}{more})"


def load_mapped_weights(model: nn.Module, mapped: Iterable[MappedWeight]) -> None:
    """Copy ``mapped`` into ``model``'s parameters.

    :param model: its ``named_parameters()`` are the targets (a tied weight appears once).
    :param mapped: items as produced by the model's name mapping.
    :raises ModelLoadError: on a tensor without a parameter, a shape mismatch, or a parameter
        (or shard, or expert) the checkpoint left unfilled.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, set[_Key]] = {}
    for source, target, shard, tensor, expert in mapped:
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {source!r} has no matching parameter "
                                 f"({target!r}) in {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        if isinstance(tensor, QuantizedTensor) and not getattr(param, "takes_quantized", False):
            tensor = tensor.dequantize(param.dtype)  # a parameter held only dense
        with torch.no_grad():
            try:
                if expert is not None:
                    if loader is None:
                        raise ValueError(f"{target} takes no per-expert tensors")
                    loader(param, tensor, shard, expert)
                elif loader is not None:
                    loader(param, tensor, shard)
                elif param.shape != tensor.shape:
                    raise ValueError(f"expected shape {tuple(param.shape)}, "
                                     f"got {tuple(tensor.shape)}")
                else:
                    param.data.copy_(tensor)
            except ValueError as exc:
                raise ModelLoadError(f"{source}: {exc}") from exc
        loaded.setdefault(target, set()).add((shard, expert))
    missing = [_describe(name, keys - loaded.get(name, set()))
               for name, keys in _expected(model).items() if keys - loaded.get(name, set())]
    if missing:
        raise ModelLoadError(f"the checkpoint left {len(missing)} parameters unfilled, e.g. "
                             f"{', '.join(missing[:5])}")


def map_fused_name(name: str, tensor: torch.Tensor) -> MappedWeight:
    """A Hugging Face tensor under the fused parameter that holds it: ``q_proj`` -> shard ``q``
    of ``qkv_proj``, ``mlp.experts.3.up_proj.weight`` -> shard ``up`` of expert 3 of the
    stacked ``mlp.experts.gate_up_proj``; any other name maps to itself."""
    parts = name.split(".")
    if (len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit()
            and parts[-2] in _EXPERT and parts[-1] == "weight"):
        stacked, shard = _EXPERT[parts[-2]]
        return MappedWeight(name, ".".join([*parts[:-3], stacked]), shard, tensor,
                            int(parts[-3]))
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, shard = _FUSED[parts[-2]]
        return MappedWeight(name, ".".join([*parts[:-2], fused, parts[-1]]), shard, tensor)
    return MappedWeight(name, name, None, tensor)
