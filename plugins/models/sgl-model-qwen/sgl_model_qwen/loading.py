"""Checkpoint loading for the Qwen models: Hugging Face names -> fused parameters and shards.

Hugging Face stores ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` separately and
every expert of a MoE layer under its own index (``mlp.experts.<e>.gate_proj.weight``); here they
land in ``qkv_proj``, ``gate_up_proj`` and the stacked :class:`~sgl.layers.FusedMoE` tensors
through each parameter's ``weight_loader``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from sgl.layers import FusedMoE, MergedColumnParallelLinear, QKVParallelLinear
from sgl.model_loader.errors import ModelLoadError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["load_qwen_weights", "map_weight_name"]

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
# checkpoint entries that are not parameters here
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# what one loaded tensor filled: (shard id, expert id)
_Key = tuple[object, object]


def map_weight_name(name: str) -> tuple[str, object, int | None]:
    """``(parameter name, shard id, expert id)`` of a Hugging Face tensor name."""
    parts = name.split(".")
    is_expert = (len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit()
                 and parts[-2] in _EXPERT and parts[-1] == "weight")
    if is_expert:
        stacked, shard = _EXPERT[parts[-2]]
        return ".".join([*parts[:-3], stacked]), shard, int(parts[-3])
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, shard = _FUSED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard, None
    return name, None, None


def _expected_keys(model: nn.Module) -> dict[str, set[_Key]]:
    """Every parameter (under its canonical name) -> the loads that must fill it."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    expected: dict[str, set[_Key]] = {}
    for prefix, module in model.named_modules():
        for local, param in module.named_parameters(recurse=False):
            name = canonical.get(id(param))
            if name != (f"{prefix}.{local}" if prefix else local):
                continue  # a tied parameter, counted under its owner
            if isinstance(module, FusedMoE):
                shards = ("down",) if local == "down_proj" else ("gate", "up")
                keys = {(s, e) for s in shards for e in module.local_expert_ids}
            elif isinstance(module, QKVParallelLinear):
                keys = {(s, None) for s in ("q", "k", "v")}
            elif isinstance(module, MergedColumnParallelLinear):
                keys = {(i, None) for i in range(len(module.output_sizes))}
            else:
                keys = {(None, None)}
            expected[name] = keys
    return expected


def load_qwen_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                      tied: bool) -> None:
    """Copy Hugging Face tensors into ``model``; :class:`ModelLoadError` for an unknown name, a
    wrong shape or a parameter left unfilled. ``tied``: skip ``lm_head.*`` (it is the
    embedding)."""
    params = dict(model.named_parameters())
    loaded: dict[str, set[_Key]] = {}
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name.startswith("lm_head.")):
            continue
        target, shard, expert = map_weight_name(name)
        param = params.get(target)
        if param is None:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}"
            )
        loader = getattr(param, "weight_loader", None)
        try:
            with torch.no_grad():
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
            raise ModelLoadError(f"{name}: {exc}") from exc
        loaded.setdefault(target, set()).add((shard, expert))
    missing = []
    for name, keys in _expected_keys(model).items():
        left = keys - loaded.get(name, set())
        if left:
            missing.append(name if keys == {(None, None)} else f"{name} ({len(left)} shards)")
    if missing:
        raise ModelLoadError(
            f"the checkpoint left {len(missing)} parameters unfilled, e.g. "
            f"{', '.join(missing[:5])}"
        )
