"""Filling a model's parameters from checkpoint tensors its ``load_weights`` has mapped.

A model family turns each Hugging Face tensor into ``(checkpoint name, parameter name, shard id,
tensor)`` items (renaming, splitting fused tensors, dropping what it does not use);
:func:`load_mapped_weights` copies them through each parameter's ``weight_loader`` and checks
that nothing was left unfilled.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from sgl.model_loader.errors import ModelLoadError

if TYPE_CHECKING:
    from torch import nn

__all__ = ["MappedWeight", "load_mapped_weights"]

#: (checkpoint name, parameter name, shard id or None, tensor)
MappedWeight = tuple[str, str, "int | str | None", torch.Tensor]


def load_mapped_weights(model: nn.Module, mapped: Iterable[MappedWeight], *,
                        fused_shards: Mapping[str, Collection[int | str]] | None = None) -> None:
    """Copy ``mapped`` into ``model``'s parameters.

    :param model: its ``named_parameters()`` are the targets (a tied weight appears once).
    :param mapped: items as produced by the model's name mapping; the checkpoint name is only
        used in error messages.
    :param fused_shards: for fused layers, the module name (``"qkv_proj"``) and the shard ids
        that must all arrive (``{"q", "k", "v"}``); other parameters need one unsharded tensor.
    :raises ModelLoadError: on a tensor without a parameter, a shape mismatch, or a parameter
        (or shard) the checkpoint left unfilled.
    """
    fused_shards = fused_shards or {}
    params = dict(model.named_parameters())
    loaded: dict[str, set[int | str | None]] = {}
    for source, target, shard, tensor in mapped:
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"checkpoint tensor {source!r} has no matching parameter "
                                 f"({target!r}) in {type(model).__name__}")
        loader = getattr(param, "weight_loader", None)
        with torch.no_grad():
            try:
                if loader is not None:
                    loader(param, tensor, shard)
                elif param.shape != tensor.shape:
                    raise ValueError(f"expected shape {tuple(param.shape)}, "
                                     f"got {tuple(tensor.shape)}")
                else:
                    param.data.copy_(tensor)
            except ValueError as exc:
                raise ModelLoadError(f"{source}: {exc}") from exc
        loaded.setdefault(target, set()).add(shard)
    missing = []
    for name in params:
        parts = name.split(".")
        expected = set(fused_shards.get(parts[-2], {None})) if len(parts) >= 2 else {None}
        absent = expected - loaded.get(name, set())
        if absent:
            missing.append(name if expected == {None} else
                           f"{name} (shards {sorted(map(str, absent))})")
    if missing:
        raise ModelLoadError(f"the checkpoint left {len(missing)} parameters unfilled, e.g. "
                             f"{', '.join(missing[:5])}")
