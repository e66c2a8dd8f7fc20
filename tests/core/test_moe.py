"""sgl.layers.moe against transformers' Qwen2-MoE router and experts, and split over ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sgl.layers import FusedMoE, TPGroup, get_tp_group, select_experts, set_tp_group

EXPERTS, TOP_K, HIDDEN, INTER = 6, 2, 16, 8


def moe_config(**overrides: Any) -> Any:
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                          moe_intermediate_size=INTER, **overrides)


def expert_weights(seed: int = 0) -> dict[tuple[int, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(EXPERTS):
        out[e, "gate"] = torch.randn(INTER, HIDDEN, generator=gen) / 4
        out[e, "up"] = torch.randn(INTER, HIDDEN, generator=gen) / 4
        out[e, "down"] = torch.randn(HIDDEN, INTER, generator=gen) / 4
    return out


def build(weights: dict[tuple[int, str], torch.Tensor], **kwargs: Any) -> FusedMoE:
    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, dtype=torch.float32, **kwargs)
    for (expert, shard), tensor in weights.items():
        param = layer.down_proj if shard == "down" else layer.gate_up_proj
        param.weight_loader(param, tensor, shard, expert)
    return layer


@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_matches_transformers(renormalize: bool) -> None:
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    router = Qwen2MoeTopKRouter(moe_config(norm_topk_prob=renormalize))
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(10, HIDDEN)
    logits, expected_weights, expected_ids = router(hidden)
    weights, ids = select_experts(logits, TOP_K, renormalize=renormalize)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=1e-6)


def test_experts_match_transformers() -> None:
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    weights = expert_weights()
    reference = Qwen2MoeExperts(moe_config())
    with torch.no_grad():
        for e in range(EXPERTS):
            reference.gate_up_proj[e] = torch.cat([weights[e, "gate"], weights[e, "up"]])
            reference.down_proj[e] = weights[e, "down"]
    layer = build(weights)
    hidden = torch.randn(9, HIDDEN)
    logits = torch.randn(9, EXPERTS)
    routing, ids = select_experts(logits, TOP_K, renormalize=False)
    with torch.no_grad():
        expected = reference(hidden, ids, routing)
        torch.testing.assert_close(layer(hidden, logits), expected, rtol=0, atol=1e-6)


def test_only_selected_experts_run() -> None:
    weights = expert_weights()
    for shard in ("gate", "up", "down"):
        weights[EXPERTS - 1, shard] = torch.full_like(weights[EXPERTS - 1, shard], float("nan"))
    layer = build(weights)
    logits = torch.randn(7, EXPERTS)
    logits[:, EXPERTS - 1] = -1e4  # nobody picks the last expert
    with torch.no_grad():
        assert torch.isfinite(layer(torch.randn(7, HIDDEN), logits)).all()


def test_split_over_tensor_and_expert_parallel_ranks() -> None:
    """Each rank's partial output sums to the unsplit layer's output."""
    weights = expert_weights(1)
    hidden, logits = torch.randn(11, HIDDEN), torch.randn(11, EXPERTS)
    with torch.no_grad():
        expected = build(weights)(hidden, logits)
        ep = [build(weights, ep_rank=r, ep_size=2) for r in range(2)]
        assert [list(layer.local_expert_ids) for layer in ep] == [[0, 1, 2], [3, 4, 5]]
        torch.testing.assert_close(sum(layer(hidden, logits) for layer in ep), expected,
                                   rtol=0, atol=1e-5)
        previous = get_tp_group()
        try:
            tp = []
            for rank in range(2):
                set_tp_group(TPGroup(rank=rank, size=2))
                tp.append(build(weights, reduce_results=False))
        finally:
            set_tp_group(previous)
        assert tp[0].gate_up_proj.shape == (EXPERTS, INTER, HIDDEN)
        torch.testing.assert_close(sum(layer(hidden, logits) for layer in tp), expected,
                                   rtol=0, atol=1e-5)


def test_weight_loader_errors_name_the_problem() -> None:
    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER)
    with pytest.raises(ValueError, match="shard_id must be one of gate, up, down, got 'w1'"):
        layer.weight_loader(layer.gate_up_proj, torch.zeros(INTER, HIDDEN), "w1", 0)
    with pytest.raises(ValueError, match=r"expert 2 up_proj: expected shape \(8, 16\)"):
        layer.weight_loader(layer.gate_up_proj, torch.zeros(HIDDEN, INTER), "up", 2)
    with pytest.raises(ValueError, match=r"expert_id must be an int in \[0, 6\)"):
        layer.weight_loader(layer.down_proj, torch.zeros(HIDDEN, INTER), "down", 6)
    with pytest.raises(ValueError, match="shard 'down' belongs to down_proj"):
        layer.weight_loader(layer.gate_up_proj, torch.zeros(HIDDEN, INTER), "down", 0)
    with pytest.raises(ValueError, match="top_k must be between 1 and num_experts"):
        FusedMoE(EXPERTS, EXPERTS + 1, HIDDEN, INTER)


# -- experts held quantized (a GGUF file served as it is, --quantization int8/int4) -------------

Q_HIDDEN, Q_INTER = 64, 32  # whole blocks of 32 values


def quantized_build(mode: str, weights: dict[tuple[int, str], Any]) -> FusedMoE:
    from sgl.layers.quantized import deferred_weights

    with deferred_weights(mode):
        layer = FusedMoE(EXPERTS, TOP_K, Q_HIDDEN, Q_INTER, dtype=torch.float32)
    assert layer.gate_up_proj.is_meta  # nothing allocated before the tensors arrive
    for (expert, shard), tensor in weights.items():
        param = layer.down_proj if shard == "down" else layer.gate_up_proj
        param.weight_loader(param, tensor, shard, expert)
    layer.process_weights_after_loading()
    return layer


def dense_build(weights: dict[tuple[int, str], torch.Tensor]) -> FusedMoE:
    layer = FusedMoE(EXPERTS, TOP_K, Q_HIDDEN, Q_INTER, dtype=torch.float32)
    for (expert, shard), tensor in weights.items():
        param = layer.down_proj if shard == "down" else layer.gate_up_proj
        param.weight_loader(param, tensor, shard, expert)
    return layer


def q_expert_weights() -> dict[tuple[int, str], torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {(e, shard): torch.randn(shape, generator=gen) / 4 for e in range(EXPERTS)
            for shard, shape in (("gate", (Q_INTER, Q_HIDDEN)), ("up", (Q_INTER, Q_HIDDEN)),
                                 ("down", (Q_HIDDEN, Q_INTER)))}


def assert_same_outputs(layer: FusedMoE, reference: FusedMoE) -> None:
    hidden, logits = torch.randn(13, Q_HIDDEN), torch.randn(13, EXPERTS)
    with torch.no_grad():  # the quantized matmuls sum in another order
        torch.testing.assert_close(layer(hidden, logits), reference(hidden, logits),
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode,layout", [("int8", "q8"), ("int4", "q4")])
def test_experts_rounded_at_load_equal_dense_experts_on_the_rounded_weights(
        mode: str, layout: str) -> None:
    from sgl.layers.quantized import QuantizedTensor

    weights = q_expert_weights()
    layer = quantized_build(mode, weights)
    assert layer.layouts == {"gate_up": layout, "down": layout}
    assert layer.gate_up_proj.dtype == (torch.uint8 if layout == "q4" else torch.int8)
    assert layer.gate_up_proj.shape[:2] == (EXPERTS, 2 * Q_INTER)
    assert layer.down_scales.shape[:2] == (EXPERTS, Q_HIDDEN)
    rounded = {key: QuantizedTensor.quantize(layout, w).dequantize()
               for key, w in weights.items()}
    assert_same_outputs(layer, dense_build(rounded))


def test_w8a8_int8_holds_the_experts_as_8_bit_blocks() -> None:
    """Under w8a8_int8 the experts are weight-only q8 blocks, whether they arrive dense or as a
    w8a8_int8 checkpoint's per-channel integers (dequantized, then rounded to blocks)."""
    from sgl.layers.quantized import QuantizedTensor

    weights = q_expert_weights()
    channels = {key: QuantizedTensor.quantize("w8", w) for key, w in weights.items()}
    for arriving in (weights, channels):
        layer = quantized_build("w8a8_int8", arriving)
        assert layer.layouts == {"gate_up": "q8", "down": "q8"}
        values = {key: w.dequantize() if isinstance(w, QuantizedTensor) else w
                  for key, w in arriving.items()}
        rounded = {key: QuantizedTensor.quantize("q8", w).dequantize()
                   for key, w in values.items()}
        assert_same_outputs(layer, dense_build(rounded))


def test_gguf_experts_keep_their_blocks_in_one_layout_per_projection() -> None:
    """Blocks stay blocks; an expert whose up projection is 8-bit widens its projection's
    4-bit experts to 8 bits (exactly); one dense expert makes its projection dense."""
    from sgl.layers.quantized import QuantizedTensor

    weights = q_expert_weights()
    blocks = {key: QuantizedTensor.quantize("q8" if key == (1, "up") else "q4", w)
              for key, w in weights.items()}
    exact = {key: b.dequantize() for key, b in blocks.items()}
    layer = quantized_build("gguf", blocks)
    assert layer.layouts == {"gate_up": "q8", "down": "q4"}
    assert_same_outputs(layer, dense_build(exact))

    blocks[2, "down"] = exact[2, "down"]  # a dense tensor among the blocks
    layer = quantized_build("gguf", blocks)
    assert layer.layouts == {"gate_up": "q8", "down": None}
    assert layer.down_proj.dtype == torch.float32 and layer.down_scales is None
    assert_same_outputs(layer, dense_build(exact))
