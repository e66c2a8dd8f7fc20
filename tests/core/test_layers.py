"""sgl.layers against the transformers implementations they replace."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sgl.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    get_rope,
    rope_inv_freq,
    rope_parameters,
)


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=4096, **overrides)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("params", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    LLAMA3,
])
def test_rope_frequencies_match_transformers(params: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = llama_config(rope_parameters=dict(params))
    if params["rope_type"] == "default":
        head_dim = config.hidden_size // config.num_attention_heads
        expected = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    got = rope_inv_freq(8, rope_parameters(config))
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)


def test_rope_parameters_of_old_style_configs() -> None:
    class Old:
        rope_theta = 1234.0
        rope_scaling = {"type": "linear", "factor": 2.0}

    assert rope_parameters(Old()) == {"type": "linear", "factor": 2.0, "rope_type": "linear",
                                      "rope_theta": 1234.0}

    class Plain:
        rope_theta = 99.0
        rope_scaling = None

    assert rope_parameters(Plain()) == {"rope_type": "default", "rope_theta": 99.0}


def test_unsupported_rope_type_lists_supported() -> None:
    with pytest.raises(ValueError, match="supported: default, linear, llama3"):
        rope_inv_freq(8, {"rope_type": "yarn", "rope_theta": 1.0})


def test_rotary_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = llama_config(rope_parameters=dict(LLAMA3))
    head_dim, tokens = 8, 11
    rope = get_rope(config, head_dim)
    # float32 cos/sin of angles in the thousands differ by ~1e-4 between vectorised and scalar
    # code paths, so stay at positions where both implementations agree closely
    positions = torch.tensor([0, 1, 2, 300, 301, 7, 250, 5, 6, 100, 200])
    q = torch.randn(tokens, 4 * head_dim)
    k = torch.randn(tokens, 2 * head_dim)
    got_q, got_k = rope(positions, q, k)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.view(1, tokens, 4, head_dim).transpose(1, 2),
                                        k.view(1, tokens, 2, head_dim).transpose(1, 2), cos, sin)
    torch.testing.assert_close(got_q, ref_q.transpose(1, 2).reshape(tokens, -1), rtol=0, atol=1e-4)
    torch.testing.assert_close(got_k, ref_k.transpose(1, 2).reshape(tokens, -1), rtol=0, atol=1e-4)


def test_rms_norm_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(16, eps=1e-5)
    ref.weight.data.normal_()
    norm = RMSNorm(16, 1e-5)
    norm.weight.data.copy_(ref.weight.data)
    x, residual = torch.randn(5, 16), torch.randn(5, 16)
    out, summed = norm(x, residual)
    torch.testing.assert_close(summed, x + residual)
    torch.testing.assert_close(out, ref(x + residual))


def test_fused_linear_loaders_place_shards() -> None:
    qkv = QKVParallelLinear(8, head_dim=2, total_num_heads=4, total_num_kv_heads=2)
    q, k, v = torch.randn(8, 8), torch.randn(4, 8), torch.randn(4, 8)
    for shard, w in (("q", q), ("k", k), ("v", v)):
        qkv.weight_loader(qkv.weight, w, shard)
    torch.testing.assert_close(qkv.weight.data, torch.cat([q, k, v]))
    x = torch.randn(3, 8)
    out_q, out_k, out_v = qkv.split(qkv(x))
    torch.testing.assert_close(out_k, x @ k.T)
    with pytest.raises(ValueError, match="'q', 'k', 'v'"):
        qkv.weight_loader(qkv.weight, q, "x")

    gate_up = MergedColumnParallelLinear(8, [5, 5])
    gate, up = torch.randn(5, 8), torch.randn(5, 8)
    gate_up.weight_loader(gate_up.weight, up, 1)
    gate_up.weight_loader(gate_up.weight, gate, 0)
    torch.testing.assert_close(gate_up.weight.data, torch.cat([gate, up]))
    with pytest.raises(ValueError, match="shape"):
        gate_up.weight_loader(gate_up.weight, torch.randn(4, 8), 0)

    row = RowParallelLinear(8, 3, bias=True)
    w, b = torch.randn(3, 8), torch.randn(3)
    row.weight_loader(row.weight, w)
    row.weight_loader(row.bias, b)
    torch.testing.assert_close(row(x), x @ w.T + b)
