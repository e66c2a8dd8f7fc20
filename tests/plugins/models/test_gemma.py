"""``sgl-model-gemma`` (Gemma 2, Gemma 3 text) through the ModelRunner, against transformers.

Tiny random models (saved as safetensors) with a sliding window of 8 tokens on the local layers,
``query_pre_attn_scalar`` unlike ``head_dim``, random norm weights (transformers initialises them
to 0, i.e. a scale of 1) and weights large enough (``initializer_range`` 0.1) that the
soft-capping values chosen below change the logits by far more than the tolerance. Reference
models use eager attention, the one that honours soft-capping.
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

# float32 on CPU: sgl and transformers differ only in summation order
ATOL = 1e-4

COMMON = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
          "sliding_window": 8, "query_pre_attn_scalar": 24, "initializer_range": 0.1}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # alternating local/global layers (the Gemma 2 default), both soft-caps
    "gemma2-softcap": ("Gemma2", {"num_hidden_layers": 3, "attn_logit_softcapping": 2.0,
                                  "final_logit_softcapping": 5.0}),
    # explicit layer_types; global layers linear-scaled (as Gemma 3 4B+), local theta 100
    "gemma3-layer_types": ("Gemma3", {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    }),
    # pre-transformers-5 keys: sliding_window_pattern, rope_local_base_freq; final soft-cap
    "gemma3-pattern-softcap": ("Gemma3", {"num_hidden_layers": 3, "sliding_window_pattern": 2,
                                          "rope_theta": 10000.0, "rope_local_base_freq": 100.0,
                                          "final_logit_softcapping": 5.0}),
}


def test_plugin_is_installed() -> None:
    assert_plugin_installed("model-gemma", {
        "Gemma2ForCausalLM": "sgl_model_gemma.model:Gemma2ForCausalLM",
        "Gemma3ForCausalLM": "sgl_model_gemma.model:Gemma3ForCausalLM",
    }, gguf_archs=("gemma2", "gemma3"))


def build_reference(family: str, overrides: dict[str, Any]) -> Any:
    import transformers

    config_cls = transformers.Gemma2Config if family == "Gemma2" else transformers.Gemma3TextConfig
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    config = config_cls(**COMMON, **overrides, attn_implementation="eager")
    torch.manual_seed(0)
    model = model_cls(config).eval()
    randomize_norms(model, std=0.5)
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request: pytest.FixtureRequest, model_isa: str,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, ModelRunner]:
    reference = build_reference(*VARIANTS[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    return reference, make_runner(str(folder))


def test_layer_specs_follow_config(tiny: tuple[Any, ModelRunner]) -> None:
    reference, runner = tiny
    config = reference.config
    assert runner.architecture == type(reference).__name__
    specs = [layer.self_attn.attn.spec for layer in runner.model.model.layers]
    assert [s.sliding_window for s in specs] == [
        8 if kind == "sliding_attention" else None for kind in config.layer_types]
    assert {s.scaling for s in specs} == {24 ** -0.5}
    softcap = config.attn_logit_softcapping if runner.architecture == "Gemma2ForCausalLM" else None
    assert {s.logit_softcap for s in specs} == {softcap}
    assert "full_attention" in config.layer_types and "sliding_attention" in config.layer_types


def test_ragged_extend_prefix_extend_and_decode(tiny: tuple[Any, ModelRunner]) -> None:
    check_ragged_extend_prefix_decode(*tiny, atol=ATOL)


def test_greedy_matches_transformers(tiny: tuple[Any, ModelRunner]) -> None:
    reference, runner = tiny
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 2, 20)]
    assert greedy(runner, prompts, steps=32) == hf_greedy(reference, prompts, 32)


def test_bidirectional_attention_is_rejected(tmp_path: Any) -> None:
    from sgl.model_loader import ModelLoadError

    reference = build_reference("Gemma3", {"num_hidden_layers": 2,
                                           "use_bidirectional_attention": True})
    reference.save_pretrained(tmp_path)
    with pytest.raises((ValueError, ModelLoadError), match="use_bidirectional_attention"):
        make_runner(str(tmp_path))
