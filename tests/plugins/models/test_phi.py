"""``sgl-model-phi`` (Phi3ForCausalLM) through the ModelRunner, against transformers.

Tiny random models (saved as safetensors, with the fused ``qkv_proj``/``gate_up_proj`` tensors
of Phi-3 checkpoints): Phi-3 style (full rotary, sliding window of 8), Phi-4-mini style (partial
rotary 0.75, tied embeddings), and LongRoPE with partial rotary and an
``original_max_position_embeddings`` of 16, so that prompts exist on both sides of it.
``initializer_range`` 0.1 makes attention peaked enough that rotary errors show in the logits.
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
    randomize_norms,
)

from sgl.engine.model_runner import ModelRunner
from sgl.layers import LongRopeRotaryEmbedding

# float32 on CPU: sgl and transformers differ only in summation order
ATOL = 1e-4

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.5, 4.0, 9.0, 23.0],
            "original_max_position_embeddings": 16}

VARIANTS: dict[str, dict[str, Any]] = {
    "phi3-window8": {"sliding_window": 8},
    "phi4mini-partial-tied": {"partial_rotary_factor": 0.75, "tie_word_embeddings": True},
    "longrope-partial": {"rope_parameters": LONGROPE, "original_max_position_embeddings": 16},
}


def test_plugin_is_installed() -> None:
    assert_plugin_installed("model-phi",
                            {"Phi3ForCausalLM": "sgl_model_phi.model:Phi3ForCausalLM"},
                            gguf_archs=("phi3",))


def build_reference(overrides: dict[str, Any]) -> Any:
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, initializer_range=0.1, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, **overrides)
    torch.manual_seed(0)
    model = Phi3ForCausalLM(config).eval()
    randomize_norms(model, std=0.3)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request: pytest.FixtureRequest, model_isa: str,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ModelRunner]:
    reference = build_reference(VARIANTS[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    return reference, make_runner(str(folder))


def is_longrope(runner: ModelRunner) -> bool:
    return isinstance(runner.model.model.layers[0].self_attn.rotary, LongRopeRotaryEmbedding)


def test_rotary_and_window_follow_config(tiny: tuple[Any, ModelRunner]) -> None:
    reference, runner = tiny
    config = reference.config
    assert runner.architecture == "Phi3ForCausalLM"
    rotary = runner.model.model.layers[0].self_attn.rotary
    assert rotary.rotary_dim == int(16 * config.rope_parameters["partial_rotary_factor"])
    assert is_longrope(runner) == (config.rope_parameters["rope_type"] == "longrope")
    specs = [layer.self_attn.attn.spec for layer in runner.model.model.layers]
    assert {s.sliding_window for s in specs} == {config.sliding_window}


def test_ragged_extend_prefix_extend_and_decode(tiny: tuple[Any, ModelRunner]) -> None:
    # LongRoPE: transformers picks short/long factors from the longest row of its batch, so
    # the reference runs one text at a time (none of them crosses 16 tokens between passes)
    reference, runner = tiny
    check_ragged_extend_prefix_decode(reference, runner, atol=ATOL,
                                      batched_reference=not is_longrope(runner))


def test_greedy_matches_transformers(tiny: tuple[Any, ModelRunner]) -> None:
    reference, runner = tiny
    # LongRoPE: prompts already past 16 tokens. A sequence that crosses 16 tokens while
    # generating gets different tokens from transformers' generate(), which then recomputes the
    # whole KV cache with the long factors; sgl keeps the cached short-factor keys (see
    # test_longrope_switches_factors_like_transformers and the plugin's README).
    lengths = (20, 17, 25) if is_longrope(runner) else (7, 2, 20)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    assert greedy(runner, prompts, steps=32) == hf_greedy(reference, prompts, 32)


def test_longrope_switches_factors_like_transformers(tmp_path: Any) -> None:
    """A sequence decoding past ``original_max_position_embeddings`` switches to the long
    factors for its new tokens while its cached keys keep the short ones, as in transformers'
    forward with a KV cache (its ``generate`` instead drops the cache at that point)."""
    from transformers import DynamicCache

    from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
    from sgl.forward_batch import ForwardMode

    reference = build_reference(VARIANTS["longrope-partial"])
    reference.save_pretrained(tmp_path)
    runner = make_runner(str(tmp_path))
    prompt = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    row = runner.req_to_token_pool.alloc()
    cache = DynamicCache(config=reference.config)
    step_ids, prefix = prompt, 0
    with torch.no_grad():
        for _ in range(5):  # sequence lengths 14, 15, 16 (short), 17, 18 (long)
            want = reference(torch.tensor([step_ids]), cache=cache,
                             use_cache=True).logits[0, -1].float()
            mode = ForwardMode.EXTEND if prefix == 0 else ForwardMode.DECODE
            got = runner.forward_logits(make_forward_batch(runner, mode,
                                                           [BatchSeq(row, prefix, step_ids)]))
            torch.testing.assert_close(got[0], want, rtol=0, atol=ATOL)
            prefix += len(step_ids)
            step_ids = [int(want.argmax())]
    release_sequence(runner, row, prefix)
