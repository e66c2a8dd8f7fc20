"""GGUF files of every model family, loaded by sgl and compared with transformers.

For each GGUF architecture sgl loads, a tiny random transformers model is written as a GGUF file
the way llama.cpp's converter writes it (``_gguf_writer``: its tensor names, q/k permutation,
Gemma's +1 norms, Phi-3's fused tensors, stacked experts, rope tensors, the metadata), as F16,
Q8_0 and Q4_0. sgl reads the config from the file's metadata and the weights from its tensors;
the reference is the transformers model given the values the file holds (the Q8_0/Q4_0
weights dequantized). Logits at every position of two prompts (7 and 20 tokens: past the
sliding windows of 8, past Phi-3's LongRoPE switch at 16) must agree.

Tolerance: 1e-4 absolute on logits of magnitude up to about 4, float32 throughout. Both sides
compute with exactly the same weight values (a quantized block dequantizes exactly in float32,
and sgl's quantized matmuls take float32 activations), so only the order of the sums differs
(observed: a few 1e-6). A wrong transform moves the logits by far more:
``test_a_missing_transform_is_caught`` drops the q/k un-permutation and Gemma's norm shift and
checks the logits then differ by more than 100 times the tolerance.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _family_parity import make_runner, randomize_norms, reference_logits
from _gguf_writer import write_gguf

from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
from sgl.engine.model_runner import ModelRunner
from sgl.kernels import cpu
from sgl.layers.moe import FusedMoE
from sgl.forward_batch import ForwardMode
from sgl.model_loader import ModelLoadError, load_hf_config, open_weights
from sgl.model_loader import gguf_config
from sgl.plugins import create_plugin_manager

ATOL = 1e-4
#: int8 activations (every quantized matmul's x rounded per block of 32) against transformers,
#: on logits spanning about 6: measured 0.03-0.1, 0.29 with Qwen2-MoE's rounded experts
ROUNDED_ATOL = 0.5
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": 0.1}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 8.0, "original_max_position_embeddings": 2048}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [1.5, 4.0, 9.0, 23.0],
            "original_max_position_embeddings": 16}

# variant -> (transformers config class, overrides, general.name); every setting is one a GGUF
# file can state (e.g. Gemma's query_pre_attn_scalar is llama.cpp's: head_dim)
VARIANTS: dict[str, tuple[str, dict[str, Any], str]] = {
    # q/k/v/o biases (permuted with their rows), Llama 3 rope scaling (rope_freqs)
    "llama": ("LlamaConfig", {"attention_bias": True, "rope_parameters": LLAMA3,
                              "max_position_embeddings": 4096}, "tiny"),
    # a llama file transformers reads as Mistral (general.name "mistral"; files named otherwise
    # load as Llama, the same network); head_dim unlike hidden / heads
    "mistral": ("MistralConfig", {"head_dim": 32, "sliding_window": None}, "mistral"),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}, "tiny"),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "tie_word_embeddings": True}, "tiny"),
    "qwen2-moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 96,
                                     "tie_word_embeddings": False}, "tiny"),
    "gemma2": ("Gemma2Config", {"num_hidden_layers": 3, "head_dim": 16,
                                "query_pre_attn_scalar": 16, "sliding_window": 8,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0},
               "tiny"),
    # six layers: the fifth is global (llama.cpp's pattern); global layers linear-scaled
    "gemma3": ("Gemma3TextConfig", {
        "num_hidden_layers": 6, "head_dim": 16, "query_pre_attn_scalar": 16,
        "sliding_window": 8, "final_logit_softcapping": 5.0,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                               "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 10000.0}}}, "tiny"),
    # fused qkv and gate/up, partial rotary LongRoPE, a sliding window
    "phi3": ("Phi3Config", {"rope_parameters": LONGROPE, "original_max_position_embeddings": 16,
                            "sliding_window": 8, "pad_token_id": 0, "bos_token_id": 1,
                            "eos_token_id": 2}, "tiny"),
}
# file type -> the --quantization values it is served with (an F16 file holds no blocks:
# auto serves it as none)
MODES = {"F16": ("none",), "Q8_0": ("none", "auto"), "Q4_0": ("none", "auto")}


def build_reference(variant: str) -> Any:
    import transformers

    config_name, overrides, _ = VARIANTS[variant]
    kwargs = {**TINY, **overrides}
    if config_name.startswith("Gemma"):
        kwargs["attn_implementation"] = "eager"  # the one that honours soft-capping
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize_norms(model, std=0.3)
    with torch.no_grad():  # biases and the MoE gates start at constants
        for name, param in model.named_parameters():
            if name.endswith("bias") or name.endswith(("mlp.gate.weight",
                                                       "shared_expert_gate.weight")):
                param.normal_(std=0.5)
    return model


PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(3)).tolist()
           for n in (7, 20)]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], tuple[Any, ...]]:
    """(variant, file type) -> (GGUF path, the reference's config, its logits of
    :data:`PROMPTS` computed with the values the file holds)."""
    out = {}
    for variant in VARIANTS:
        folder = tmp_path_factory.mktemp(variant)
        for qtype in MODES:
            model = build_reference(variant)
            path = folder / f"{variant}-{qtype}.gguf"
            held = write_gguf(model, path, qtype, title=VARIANTS[variant][2])
            missing, unexpected = model.load_state_dict(held, strict=False)
            assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head
            expected = reference_logits(model, PROMPTS, batched=False)
            out[variant, qtype] = (path, model.config, expected)
    return out


def sgl_logits(runner: ModelRunner, prompts: list[list[int]] = PROMPTS) -> list[torch.Tensor]:
    """sgl's logits at every position of ``prompts``, all in one ragged extend."""
    rows = [runner.req_to_token_pool.alloc() for _ in prompts]
    batch = make_forward_batch(runner, ForwardMode.EXTEND,
                               [BatchSeq(r, 0, p) for r, p in zip(rows, prompts)])
    logits = runner.logits_at(runner.forward(batch), torch.arange(batch.num_tokens))
    for row, prompt in zip(rows, prompts):
        release_sequence(runner, row, len(prompt))
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize(("qtype", "quantization"),
                         [(q, mode) for q, modes in MODES.items() for mode in modes])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gguf_logits_match_transformers(files: dict, variant: str, qtype: str,
                                        quantization: str, model_isa: str) -> None:
    path, _, expected = files[variant, qtype]
    # every product exact: transformers multiplies the dequantized weights by float32 x
    runner = make_runner(str(path), quantization=quantization, int8_activations="off")
    held = {m.weight_layout for m in runner.model.modules() if getattr(m, "weight_layout", None)}
    # a Q4_0 file's token_embd is Q8_0
    assert held == (set() if quantization == "none" else {"q8"} if qtype == "Q8_0"
                    else {"q4", "q8"}), held
    experts = [m.layouts for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert (variant == "qwen2-moe") == bool(experts)
    for layouts in experts:  # the experts keep the file's blocks too
        want_layout = None if quantization == "none" else "q8" if qtype == "Q8_0" else "q4"
        assert layouts == {"gate_up": want_layout, "down": want_layout}, layouts
    for got, want in zip(sgl_logits(runner), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
    if quantization == "none":
        return
    # the default (int8 activations where the kernels run, as llama.cpp multiplies the file):
    # within the rounding of x, at most max|x| / 254 per value and layer
    rounded = make_runner(str(path), quantization=quantization)
    assert rounded.round_x == (model_isa != "none")
    for got, want in zip(sgl_logits(rounded), expected):
        error = (got - want).abs().max()
        assert error <= ROUNDED_ATOL, error
        if rounded.round_x:
            assert error > ATOL


#: a llama wide enough for K-quants (rows of whole 256-value super-blocks)
WIDE = {**TINY, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2}


@pytest.mark.parametrize("tied", [True, False])
def test_a_q6_k_file_keeps_its_blocks_and_matches_transformers(tmp_path: Path, tied: bool,
                                                               model_isa: str) -> None:
    """Every projection, the embedding and the head in Q6_K (as a Q6_K file and the Q6_K
    tensors of Q4_K_M files hold them): where the kernels round x (the default) the layers hold
    Q6_K's own integers and scales (q6x16) where the CPU multiplies that layout, q8 elsewhere;
    the logits are transformers' on the file's values within x's rounding, and within the
    rounding of q8 without it."""
    import transformers

    config = transformers.LlamaConfig(**WIDE, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    randomize_norms(model, std=0.3)
    path = tmp_path / "wide-q6_k.gguf"
    held = write_gguf(model, path, "Q6_K")
    model.load_state_dict(held, strict=False)
    expected = reference_logits(model, PROMPTS, batched=False)
    rounded = make_runner(str(path), quantization="auto")
    layouts = {m.weight_layout for m in rounded.model.modules()
               if getattr(m, "weight_layout", None)}
    packs = rounded.round_x and cpu.packs_x16()
    assert layouts == ({"q6x16"} if packs and tied else {"q6x16", "q8"} if packs else {"q8"})
    exact = make_runner(str(path), quantization="auto", int8_activations="off")
    assert {m.weight_layout for m in exact.model.modules()
            if getattr(m, "weight_layout", None)} == {"q8"}
    for runner in (rounded, exact):
        together = sgl_logits(runner)
        for got, want in zip(together, expected):
            error = (got - want).abs().max()
            assert ATOL < error <= ROUNDED_ATOL, error
        for prompt, got in zip(PROMPTS, together):  # a prompt's bits do not depend on the batch
            assert torch.equal(sgl_logits(runner, [prompt])[0], got)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_from_metadata(files: dict, variant: str, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What sgl reads from the metadata matches the config the file was written from, also
    when it comes back from sgl's disk cache."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from sgl.layers.rotary import rope_inv_freq

    path, reference, _ = files[variant, "F16"]
    monkeypatch.setenv("SGL_CACHE_DIR", str(tmp_path))
    built, cached = load_hf_config(path), load_hf_config(path)
    assert list((tmp_path / "gguf").iterdir())  # the second came from the cache
    for config in (built, cached):
        assert config.architectures == [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[reference.model_type]]
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "tie_word_embeddings", "head_dim",
                    "attention_bias", "query_pre_attn_scalar", "attn_logit_softcapping",
                    "final_logit_softcapping", "sliding_window", "layer_types",
                    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                    "num_experts_per_tok"):
            if hasattr(reference, key):
                assert getattr(config, key, None) == getattr(reference, key), key
        want, got = dict(reference.rope_parameters), dict(config.rope_parameters)
        if variant == "llama":  # from rope_freqs: other low/high factors, the same frequencies
            assert got["rope_type"] == "llama3"
            torch.testing.assert_close(rope_inv_freq(16, got), rope_inv_freq(16, want),
                                       rtol=1e-6, atol=0)
        else:
            for key, value in want.items():
                assert got.get(key) == pytest.approx(value), key


def test_llama3_rope_parameters_round_trip() -> None:
    """Llama 3.1 8B's scaling: the factors the converter writes give back the same frequencies
    (here with other low/high factors than the fitted low_freq_factor of 1)."""
    from sgl.layers.rotary import rope_inv_freq

    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
              "low_freq_factor": 2.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}

    class Config:
        rope_parameters = params

    import _gguf_writer

    factors = _gguf_writer._llama3_factors(Config, 128).numpy()
    fitted = gguf_config.rope_from_freq_factors(factors, 500000.0, 128)
    assert fitted is not None and fitted["low_freq_factor"] == 1.0
    torch.testing.assert_close(rope_inv_freq(128, {**fitted, "rope_theta": 500000.0}),
                               rope_inv_freq(128, params), rtol=1e-6, atol=0)
    assert gguf_config.rope_from_freq_factors(np.ones(64), 500000.0, 128) is None
    with pytest.raises(ModelLoadError, match="not llama3-type rope scaling"):
        gguf_config.rope_from_freq_factors(np.linspace(1, 8, 64) ** 2, 500000.0, 128)


@pytest.mark.parametrize(("variant", "change"), [
    ("llama", {"permuted_qk": False}),
    ("mistral", {"permuted_qk": False}),
    ("gemma2", {"norm_shift": 0.0}),
    ("gemma3", {"norm_shift": 0.0}),
])
def test_a_missing_transform_is_caught(files: dict, variant: str, change: dict[str, Any],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without one of the converter's transforms undone, the logits are far off."""
    path, _, expected = files[variant, "Q8_0"]
    # the architecture as its plugin registered it, changed where the registry imports it from
    name = {"mistral": "llama"}.get(variant, variant)
    entry = create_plugin_manager().registries.gguf_archs.entry(name)
    module, attr = entry.target.split(":")
    arch = entry.load()
    monkeypatch.setattr(importlib.import_module(module), attr, dataclasses.replace(arch, **change))
    got = sgl_logits(make_runner(str(path), quantization="auto"))
    worst = max(float((g - w).abs().max()) for g, w in zip(got, expected))
    assert worst > 100 * ATOL, worst


def test_fused_and_stacked_tensors_are_split(files: dict) -> None:
    """Phi-3's attn_qkv and ffn_up, Qwen2-MoE's expert stacks: one tensor per Hugging Face
    projection, quantized blocks cut by rows."""
    from sgl.layers.quantized import QuantizedTensor

    weights = dict(open_weights(files["phi3", "Q4_0"][0], quantized=True))
    q, k, v = (weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert all(isinstance(t, QuantizedTensor) for t in (q, k, v))
    assert (q.shape, k.shape, v.shape) == ((64, 64), (32, 64), (32, 64))
    assert weights["model.layers.1.mlp.gate_proj.weight"].shape == (128, 64)
    assert weights["model.layers.1.mlp.up_proj.weight"].shape == (128, 64)
    source = open_weights(files["qwen2-moe", "Q8_0"][0], quantized=True)
    moe = dict(source)
    assert len(source) == len(moe)
    assert moe["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (64, 32)
    assert moe["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
    assert not any(name.startswith(("rope_", "model.rope")) for name in weights)


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    supported = "supported GGUF architectures: gemma2, gemma3, llama, phi3, qwen2, qwen2moe, qwen3"
    for load in (load_hf_config, open_weights):
        with pytest.raises(ModelLoadError, match=f"architecture 'falcon'.*{supported}"):
            load(path)
