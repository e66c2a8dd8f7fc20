"""The optional layer features model families opt into (Gemma norms, embedding scale, final
soft-capping, per-layer-type rope, LongRoPE) and the shared weight-loading helper."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from sgl.layers import (
    LongRopeRotaryEmbedding,
    MergedColumnParallelLinear,
    ParallelLMHead,
    RMSNorm,
    VocabParallelEmbedding,
    get_rope,
    rope_inv_freq,
    rope_parameters,
)
from sgl.model_loader import ModelLoadError
from sgl.models import MappedWeight, load_mapped_weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_weight_offset_matches_gemma(dtype: torch.dtype) -> None:
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

    reference = Gemma2RMSNorm(32, eps=1e-6)
    reference.weight.data.normal_()
    ours = RMSNorm(32, 1e-6, dtype=dtype, weight_offset=1.0)
    ours.weight.data.copy_(reference.weight.data.to(dtype))
    reference = reference.to(dtype)
    x, residual = torch.randn(5, 32).to(dtype), torch.randn(5, 32).to(dtype)
    out, summed = ours(x, residual)
    assert torch.equal(summed, x + residual)
    assert torch.equal(out, reference(x + residual))


def test_rmsnorm_defaults_unchanged() -> None:
    norm = RMSNorm(8)
    assert norm.weight_offset == 0.0 and torch.equal(norm.weight, torch.ones(8))
    assert torch.equal(RMSNorm(8, weight_offset=1.0).weight, torch.zeros(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_scale_rounds_like_gemma(dtype: torch.dtype) -> None:
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    reference = Gemma2TextScaledWordEmbedding(50, 3072, 0, embed_scale=3072 ** 0.5).to(dtype)
    ours = VocabParallelEmbedding(50, 3072, dtype=dtype, scale=3072 ** 0.5)
    ours.weight.data.copy_(reference.weight.data)
    ids = torch.tensor([0, 3, 49, 3])
    assert torch.equal(ours(ids), reference(ids))
    assert VocabParallelEmbedding(4, 2).scale is None


def test_lm_head_final_softcap() -> None:
    head = ParallelLMHead(10, 4, logit_softcap=3.0)
    head.weight.data.normal_(std=5.0)
    hidden = torch.randn(2, 4)
    raw = hidden @ head.weight.T
    torch.testing.assert_close(head(hidden), torch.tanh(raw / 3.0) * 3.0)
    assert ParallelLMHead(10, 4, logit_softcap=0.0).logit_softcap is None


def test_rope_parameters_per_layer_type() -> None:
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(rope_theta=1e6, rope_local_base_freq=100.0,
                              rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert rope_parameters(config)["rope_type"] == "linear"
    local = rope_parameters(config, layer_type="sliding_attention")
    assert (local["rope_type"], local["rope_theta"]) == ("default", 100.0)
    rotary = get_rope(config, 16, layer_type="sliding_attention")
    torch.testing.assert_close(rotary.cos_sin[1, :8].acos(), 1.0 / 100.0 ** (
        torch.arange(0, 16, 2).float() / 16))


def phi3_longrope_config(**overrides: Any) -> Any:
    from transformers import Phi3Config

    params = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
              "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.5, 4.0, 9.0, 23.0],
              "original_max_position_embeddings": 16, **overrides}
    return Phi3Config(vocab_size=64, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, original_max_position_embeddings=16,
                      rope_parameters=params, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("overrides", [{}, {"attention_factor": 1.25}])
def test_longrope_tables_match_transformers(overrides: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = phi3_longrope_config(**overrides)
    rotary = get_rope(config, 16)
    assert isinstance(rotary, LongRopeRotaryEmbedding) and rotary.rotary_dim == 8
    positions = torch.arange(64, dtype=torch.float32)
    for long, rows in ((False, slice(0, 64)), (True, slice(64, 128))):
        inv_freq, scale = ROPE_INIT_FUNCTIONS["longrope"](config, None,
                                                          seq_len=17 if long else None)
        freqs = torch.outer(positions, inv_freq)
        expected = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
        torch.testing.assert_close(rotary.cos_sin[rows], expected, rtol=0, atol=1e-6)


def test_longrope_picks_the_table_per_sequence() -> None:
    rotary = get_rope(phi3_longrope_config(), 16)
    assert isinstance(rotary, LongRopeRotaryEmbedding)
    # three sequences: 3 new tokens at 14..16 (length 17: long), 2 at 0..1 (short), 1 at 15
    positions = torch.tensor([14, 15, 16, 0, 1, 15])
    rows = rotary.cache_positions(positions, torch.tensor([17, 2, 16]), torch.tensor([3, 2, 1]))
    assert rows.tolist() == [78, 79, 80, 0, 1, 15]


def test_longrope_needs_get_rope_and_is_listed() -> None:
    with pytest.raises(ValueError, match="get_rope"):
        rope_inv_freq(8, {"rope_type": "longrope", "rope_theta": 1.0})
    with pytest.raises(ValueError, match="supported: .*longrope"):
        rope_inv_freq(8, {"rope_type": "yarn", "rope_theta": 1.0})


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(4, [3, 3])
        self.norm = RMSNorm(4)


def test_load_mapped_weights_fills_and_checks() -> None:
    model = _Fused()
    gate, up, norm = torch.randn(3, 4), torch.randn(3, 4), torch.randn(4)
    load_mapped_weights(model, [MappedWeight("g", "gate_up_proj.weight", 0, gate),
                                MappedWeight("u", "gate_up_proj.weight", 1, up),
                                MappedWeight("n", "norm.weight", None, norm)])
    assert torch.equal(model.gate_up_proj.weight, torch.cat([gate, up]))
    assert torch.equal(model.norm.weight, norm)

    with pytest.raises(ModelLoadError, match=r"gate_up_proj.weight \(shards \['1'\]\)"):
        load_mapped_weights(_Fused(), [MappedWeight("g", "gate_up_proj.weight", 0, gate),
                                       MappedWeight("n", "norm.weight", None, norm)])
    with pytest.raises(ModelLoadError, match="'extra' has no matching parameter"):
        load_mapped_weights(_Fused(), [MappedWeight("extra", "nope.weight", None, norm)])
    with pytest.raises(ModelLoadError, match="n: expected shape"):
        load_mapped_weights(_Fused(), [MappedWeight("n", "norm.weight", None, torch.zeros(5))])
