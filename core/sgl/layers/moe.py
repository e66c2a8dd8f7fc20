"""Mixture of experts: top-k routing and a fused-experts layer that runs only the chosen experts.

:class:`FusedMoE` stores every expert's weights stacked, ``gate_up_proj [experts, 2 * inter,
hidden]`` and ``down_proj [experts, hidden, inter]``, and computes a batch by sorting the
(token, expert) pairs by expert, running each selected expert once on its contiguous group of
tokens and scattering the weighted results back. Experts no token picked cost nothing.

It is laid out to be split later without changing its callers:

* tensor parallelism splits each expert's intermediate size (like ``gate_up_proj`` /
  ``down_proj`` of a dense MLP) and all-reduces the output;
* expert parallelism gives a rank the experts ``[ep_rank * E / ep_size, (ep_rank + 1) * E /
  ep_size)``; the weight loader skips other ranks' experts and the forward pass leaves their
  (token, expert) pairs out, so each rank returns a partial sum to be reduced over the EP group.

Built inside :func:`~sgl.layers.quantized.deferred_weights` (a GGUF file served quantized,
``--quantization int8``/``int4``), the experts are held as their tensors arrive, as the linear
layers are (:mod:`sgl.layers.quantized`): each expert's projection is collected on its own
(quantized blocks stay blocks, and under ``int8``/``int4`` a dense one is rounded), and after
loading the experts of a projection are stacked in one layout (``q4`` widened to ``q8`` where
they differ; all dequantized if one arrived dense). ``gate_up_proj`` and ``down_proj`` then hold
the blocks' integers ``[experts, rows, blocks, bytes]``, ``gate_up_scales`` and
``down_scales`` their float16 scales, and ``layouts`` says which projection is held how.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sgl.kernels import quant
from sgl.layers.activation import GatedActivation
from sgl.layers.quantized import (QUANTIZE_MODES, QuantizedTensor, deferred_mode,
                                  deferred_round_x, init_weight, quantized_linear,
                                  store_weight_rows)
from sgl.layers.tp import divide, get_tp_group, tp_all_reduce

__all__ = ["PROJECTIONS", "SUPPORTED_MOE_SHARDS", "FusedMoE", "select_experts"]

#: ``shard_id`` values of :meth:`FusedMoE.weight_loader`: the Hugging Face per-expert projections
SUPPORTED_MOE_SHARDS = ("gate", "up", "down")
#: the stacked projections of :class:`FusedMoE`
PROJECTIONS = ("gate_up", "down")


class _ExpertWeight(nn.Module):
    """One expert's projection while a quantizing mode loads it: the holder
    :func:`~sgl.layers.quantized.store_weight_rows` fills, as it fills a linear layer."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype | None,
                 device: torch.device | str | None) -> None:
        super().__init__()
        init_weight(self, rows, cols, dtype, device, self.weight_loader)

    def weight_loader(self, *args: object) -> None:
        raise RuntimeError("an expert's projection is loaded through FusedMoE.weight_loader")

    def held(self) -> QuantizedTensor | torch.Tensor:
        if self.weight_layout is None:
            return self.weight.data
        return QuantizedTensor(self.weight_layout, self.weight.data, self.weight_scales)


def select_experts(router_logits: torch.Tensor, top_k: int, *,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: ``[T, E]`` logits -> float32 weights ``[T, top_k]`` and expert ids
    ``[T, top_k]`` (int64), best first.

    The softmax runs in float32 over all experts; with ``renormalize`` the chosen weights are
    rescaled to sum to one (``norm_topk_prob``; equal to a softmax over the top-k logits).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """``num_experts`` gated MLPs of which each token uses ``top_k``, weighted by its router.

    :param num_experts: experts in the checkpoint (all EP ranks together).
    :param top_k: experts per token.
    :param hidden_size: model width.
    :param intermediate_size: one expert's intermediate size (unsplit).
    :param renormalize: rescale the top-k weights to sum to one (``norm_topk_prob``).
    :param activation: the gated activation, one of ``SUPPORTED_GATED_ACTIVATIONS``.
    :param reduce_results: all-reduce the output over the tensor-parallel group; False lets the
        caller fuse that reduction with another (e.g. a shared expert's).
    :param ep_rank: this rank's index in the expert-parallel group.
    :param ep_size: ranks the experts are divided among (1: every rank holds all experts).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 *, renormalize: bool = False, activation: str = "silu",
                 reduce_results: bool = True, ep_rank: int = 0, ep_size: int = 1,
                 dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be between 1 and num_experts ({num_experts}), "
                             f"got {top_k}")
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"expert-parallel rank {ep_rank} is outside [0, {ep_size})")
        self.tp = get_tp_group()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.num_local_experts = divide(num_experts, ep_size, "number of experts")
        self.expert_start = ep_rank * self.num_local_experts
        self.partition = divide(intermediate_size, self.tp.size, "expert intermediate size")
        self.act = GatedActivation(activation)
        shape_13 = (self.num_local_experts, 2 * self.partition, hidden_size)
        shape_2 = (self.num_local_experts, hidden_size, self.partition)
        self.dtype = dtype or torch.get_default_dtype()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        #: ``{"gate_up": layout, "down": layout}``: ``"q4"``, ``"q8"`` or None (dense)
        self.layouts: dict[str, str | None] = dict.fromkeys(PROJECTIONS)
        self.mode = deferred_mode()
        #: whether the experts' quantized matmuls round x to int8 (--int8-activations)
        self.round_x = deferred_round_x()
        #: quantizing modes: each local expert's projections until they are stacked (a plain
        #: dict, so that the holders are no submodules and never loaded by name)
        self.pending: dict[str, list[_ExpertWeight]] | None = None
        place = device
        if self.mode is not None:
            place = "meta"
            self.pending = {
                "gate_up": [_ExpertWeight(2 * self.partition, hidden_size, dtype, device)
                            for _ in range(self.num_local_experts)],
                "down": [_ExpertWeight(hidden_size, self.partition, dtype, device)
                         for _ in range(self.num_local_experts)]}
        self.gate_up_proj = nn.Parameter(torch.empty(shape_13, dtype=dtype, device=place),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(shape_2, dtype=dtype, device=place),
                                      requires_grad=False)
        self.register_buffer("gate_up_scales", None)
        self.register_buffer("down_scales", None)
        for param in (self.gate_up_proj, self.down_proj):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
            param.takes_quantized = True  # type: ignore[attr-defined]

    @property
    def local_expert_ids(self) -> range:
        """Global ids of the experts this rank holds."""
        return range(self.expert_start, self.expert_start + self.num_local_experts)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor,
                      shard_id: int | str | None = None, expert_id: int | None = None) -> None:
        """Copy one expert's full Hugging Face projection (``gate``/``up``: ``[inter, hidden]``,
        ``down``: ``[hidden, inter]``, dense or a :class:`QuantizedTensor`) into this rank's
        slice; other ranks' experts are skipped."""
        if shard_id not in SUPPORTED_MOE_SHARDS:
            raise ValueError(f"shard_id must be one of {', '.join(SUPPORTED_MOE_SHARDS)}, "
                             f"got {shard_id!r}")
        if not isinstance(expert_id, int) or not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert_id must be an int in [0, {self.num_experts}), "
                             f"got {expert_id!r}")
        wanted = self.down_proj if shard_id == "down" else self.gate_up_proj
        if param is not wanted:
            raise ValueError(f"shard {shard_id!r} belongs to "
                             f"{'down_proj' if shard_id == 'down' else 'gate_up_proj'}")
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        size, rank = self.partition, self.tp.rank
        expected: tuple[int, ...] = ((self.hidden_size, self.intermediate_size)
                                     if shard_id == "down" else
                                     (self.intermediate_size, self.hidden_size))
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expert {expert_id} {shard_id}_proj: expected shape {expected}, "
                             f"got {tuple(loaded.shape)}")
        if isinstance(loaded, QuantizedTensor) and (
                self.pending is None or loaded.layout == quant.CHANNEL_LAYOUT
                or (shard_id == "down" and size % quant.BLOCK)):
            # held dense, a split that cuts blocks, or a w8a8_int8 checkpoint's per-channel
            # expert (the experts are held as blocks)
            loaded = loaded.dequantize(self.dtype)
        source = (loaded.narrow(1, rank * size, size) if shard_id == "down"
                  else loaded.narrow(0, rank * size, size))
        offset = size if shard_id == "up" else 0
        if self.pending is not None:
            holder = self.pending["down" if shard_id == "down" else "gate_up"][local]
            # under w8a8_int8 the experts are 8-bit blocks, weight-only (no per-channel
            # expert matmul yet)
            layout = QUANTIZE_MODES.get(self.mode or "")
            store_weight_rows(holder, offset, source, f"expert {expert_id} {shard_id}_proj",
                              quantize_as="q8" if layout == quant.CHANNEL_LAYOUT else layout)
            return
        target = param.data[local] if shard_id == "down" else \
            param.data[local].narrow(0, offset, size)
        target.copy_(source)

    def process_weights_after_loading(self) -> None:
        """In a quantizing mode: stack each projection's experts in one layout (see the module
        docstring)."""
        if self.pending is None:
            return
        for which, holders in self.pending.items():
            held = [h.held() for h in holders]
            layouts = {h.layout if isinstance(h, QuantizedTensor) else None for h in held}
            if None in layouts:  # one dense expert: all dense
                stacked = torch.stack([h if not isinstance(h, QuantizedTensor)
                                       else h.dequantize(self.dtype) for h in held])
                layout, scales = None, None
            else:
                # one layout the expert kernels take: q4 alone stays q4, any other mix
                # (q8, q6) is held as q8
                layout = "q4" if layouts == {"q4"} else "q8"
                blocks = [h.with_layout(layout) for h in held]
                stacked = torch.stack([b.qweight.contiguous() for b in blocks])
                scales = torch.stack([b.scales.contiguous() for b in blocks])
            setattr(self, f"{which}_proj", nn.Parameter(stacked, requires_grad=False))
            setattr(self, f"{which}_scales", scales)
            self.layouts[which] = layout
        self.pending = None

    def _project(self, which: str, x: torch.Tensor, expert: int) -> torch.Tensor:
        weight = getattr(self, f"{which}_proj")[expert]
        layout = self.layouts[which]
        if layout is None:
            return F.linear(x, weight)
        return quantized_linear(x, layout, weight, getattr(self, f"{which}_scales")[expert],
                                None, round_x=self.round_x)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``hidden [T, hidden]``, ``router_logits [T, num_experts]`` -> ``[T, hidden]``."""
        weights, ids = select_experts(router_logits, self.top_k, renormalize=self.renormalize)
        return self.forward_experts(hidden, weights, ids)

    def forward_experts(self, hidden: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor) -> torch.Tensor:
        """The experts with routing already chosen (for routers other than softmax top-k):
        ``sum_j weights[t, j] * expert_{ids[t, j]}(hidden[t])``."""
        tokens, top_k = ids.shape
        local = ids.reshape(-1) - self.expert_start
        if self.num_local_experts != self.num_experts:  # other ranks' pairs go to a spare bucket
            outside = (local < 0) | (local >= self.num_local_experts)
            local = local.masked_fill(outside, self.num_local_experts)
        order = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.num_local_experts + 1).tolist()
        grouped = hidden.index_select(0, order // top_k)  # pair i's token, grouped by expert
        out = hidden.new_zeros(tokens * top_k, self.hidden_size)
        start = 0
        for expert, count in enumerate(counts[:self.num_local_experts]):
            if count:
                end = start + count
                x = self._project("gate_up", grouped[start:end], expert)
                out[order[start:end]] = self._project("down", self.act(x), expert)
                start = end
        combined = (out.view(tokens, top_k, -1) * weights.to(hidden.dtype).unsqueeze(-1)).sum(1)
        if self.reduce_results and self.tp.size > 1:
            combined = tp_all_reduce(combined)
        return combined
