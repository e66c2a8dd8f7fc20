"""SGLang's ``w8a8_int8`` checkpoints (``quant_method: w8a8_int8``: ``weight`` int8 and
``weight_scale`` per output channel) served as ``w8`` layers multiplied by ``sgl::linear_w8a8``.

The checkpoint is a tiny random Llama whose linear weights are rounded per channel and saved as
SGLang's format; served as it is stored it must give the same logits, bit for bit, as the dense
model rounded at load (``--quantization w8a8_int8``), and served with ``none`` the dequantized
model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
from sgl.engine.model_runner import ModelRunner, resolve_quantization
from sgl.forward_batch import ForwardMode
from sgl.kernels import quant
from sgl.model_loader import bundled_model_path
from sgl.plugins import create_plugin_manager

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_dense(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def write_w8a8(dense: Path, path: Path) -> Path:
    """``dense`` with every decoder linear weight rounded per channel and stored as SGLang's
    ``w8a8_int8`` checkpoints store it."""
    path.mkdir()
    tensors = load_file(str(dense / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEAR:
            q, scale = quant.quantize("w8", tensor)
            out[name], out[name.removesuffix("weight") + "weight_scale"] = q, scale
        else:
            out[name] = tensor
    save_file(out, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "w8a8_int8", "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def runner(path: Path, quantization: str = "auto") -> ModelRunner:
    pm = create_plugin_manager()
    return ModelRunner(model_path=str(path), quantization=quantization, dtype="bfloat16",
                       registries=pm.registries, plugin_manager=pm, max_total_tokens=512,
                       max_running_requests=2, show_progress=False)


def logits_of(served: ModelRunner, prompt: list[int]) -> torch.Tensor:
    row = served.req_to_token_pool.alloc()
    batch = make_forward_batch(served, ForwardMode.EXTEND, [BatchSeq(row, 0, prompt)])
    logits = served.logits_at(served.forward(batch), torch.arange(len(prompt)))
    release_sequence(served, row, len(prompt))
    return logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("w8a8_int8")
    dense = write_dense(root / "dense")
    return dense, write_w8a8(dense, root / "w8a8")


def test_a_w8a8_int8_checkpoint_is_served_as_stored(folders: tuple[Path, Path]) -> None:
    dense, stored = folders
    prompt = torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    served = runner(stored)
    assert served.quantization == "w8a8_int8"
    layer = served.model.model.layers[1]
    assert {layer.self_attn.qkv_proj.weight_layout, layer.mlp.down_proj.weight_layout} == {"w8"}
    assert served.model.lm_head.weight_layout is None
    rounded_at_load = runner(dense, "w8a8_int8")
    with torch.inference_mode():
        got = logits_of(served, prompt)
        assert torch.equal(got, logits_of(rounded_at_load, prompt))
        dequantized = runner(stored, "none")
        assert dequantized.model.model.layers[1].mlp.down_proj.weight_layout is None
        # dense products of the same weights: only x's rounding differs
        want = logits_of(dequantized, prompt)
    error = (got - want).abs()
    assert 0 < error.max() < 0.1 * want.abs().max()


def test_quantization_modes_of_w8a8_int8_checkpoints(folders: tuple[Path, Path]) -> None:
    from sgl.model_loader import load_hf_config

    _, stored = folders
    config = load_hf_config(stored)
    assert resolve_quantization("auto", stored, config) == "w8a8_int8"
    assert resolve_quantization("w8a8_int8", stored, config) == "w8a8_int8"
    assert resolve_quantization("none", stored, config) == "none"
    with pytest.raises(ValueError, match="already quantized"):
        resolve_quantization("int8", stored, config)
    config.quantization_config = {"quant_method": "w8a8_int8", "activation_scheme": "static"}
    with pytest.raises(ValueError, match="static activation scales"):
        resolve_quantization("auto", stored, config)
    with pytest.raises(ValueError, match="rounds a Hugging Face checkpoint"):
        resolve_quantization("w8a8_int8", bundled_model_path(), config)


def test_a_malformed_layer_is_named(tmp_path: Path, folders: tuple[Path, Path]) -> None:
    from sgl.model_loader.errors import ModelLoadError

    _, stored = folders
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors: dict[str, Any] = load_file(str(stored / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:3]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text((stored / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="down_proj.weight_scale: \\[3, 1\\] is not one "
                                             "scale per output channel"):
        runner(bad)
