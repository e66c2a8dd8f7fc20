"""``sgl-model-mistral`` through the ModelRunner, against transformers.

Tiny random Mistral models (saved as safetensors): one with a sliding window of 8 tokens, shorter
than most prompts, and an explicit ``head_dim`` unlike ``hidden / heads``; one with full
attention and tied embeddings.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _family_parity import (
    assert_plugin_installed,
    check_ragged_extend_prefix_decode,
    greedy,
    hf_greedy,
    make_runner,
)

from sgl.engine.model_runner import ModelRunner

# float32 on CPU: sgl and transformers differ only in summation order
ATOL = 1e-4

VARIANTS = {
    "window8-head_dim32": {"sliding_window": 8, "head_dim": 32},
    "full-tied": {"sliding_window": None, "tie_word_embeddings": True},
}


def test_plugin_is_installed() -> None:
    assert_plugin_installed("model-mistral",
                            {"MistralForCausalLM": "sgl_model_mistral.model:MistralForCausalLM"})


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request: pytest.FixtureRequest, model_isa: str,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ModelRunner]:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=256, **VARIANTS[request.param])
    reference = MistralForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    return reference, make_runner(str(folder))


def test_runner_shape(tiny: tuple[Any, ModelRunner]) -> None:
    reference, runner = tiny
    assert runner.architecture == "MistralForCausalLM"
    window = reference.config.sliding_window
    specs = [layer.self_attn.attn.spec for layer in runner.model.model.layers]
    assert {s.sliding_window for s in specs} == {window}
    assert runner.kv_pool.k_buffer[0].shape[-1] == reference.config.head_dim


def test_ragged_extend_prefix_extend_and_decode(tiny: tuple[Any, ModelRunner]) -> None:
    check_ragged_extend_prefix_decode(*tiny, atol=ATOL)


def test_greedy_matches_transformers(tiny: tuple[Any, ModelRunner]) -> None:
    reference, runner = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 2, 20)]
    assert greedy(runner, prompts, steps=32) == hf_greedy(reference, prompts, 32)
