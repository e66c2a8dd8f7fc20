"""compressed-tensors checkpoints (``pack-quantized`` W4A16 / W8A16, what llm-compressor writes)
served as the blocks of sgl's quantized kernels.

The checkpoints are tiny random Llamas compressed by the ``compressed_tensors`` library itself
(its quantization lifecycle and ``ModelCompressor``), in bfloat16 as such checkpoints are. The
reference is the library's own decompression: transformers loading the folder, and, for the
asymmetric schemes (whose packed zero points this transformers version reinitialises when it
loads them), the same tiny Llama dense with the weights ``PackedQuantizationCompressor`` gives
back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sgl.engine.batch_builder import BatchSeq, make_forward_batch, release_sequence
from sgl.engine.model_runner import ModelRunner, resolve_quantization
from sgl.forward_batch import ForwardMode
from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader import bundled_model_path, load_hf_config, open_weights
from sgl.plugins import create_plugin_manager

#: (bits, group size (0: per output channel), symmetric) of each scheme tested
SCHEMES = {"w4-g32": (4, 32, True), "w4-g128-asym": (4, 128, False), "w8-channel": (8, 0, True),
           "w8-g64-asym": (8, 64, False), "w4-g16": (4, 16, True)}
#: the layout each scheme is held in (groups of 16 are not whole blocks: dense)
LAYOUTS = {"w4-g32": "q4", "w4-g128-asym": "q4", "w8-channel": "q8", "w8-g64-asym": "q8",
           "w4-g16": None}


def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def write_checkpoint(path: Path, bits: int, group: int, symmetric: bool) -> Path:
    """The tiny Llama quantized weight-only (scales from each group's range, as
    ``calculate_qparams`` computes them) and saved ``pack-quantized`` by compressed-tensors;
    the LM head stays dense, as llm-compressor's recipes leave it."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = tiny_llama()
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy="group" if group else "channel", group_size=group or None)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"]))
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "weight_scale"):
                weight = module.weight.float()
                grouped = weight.view(weight.shape[0], -1, group or weight.shape[1])
                scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
                module.weight_scale.copy_(scale.view_as(module.weight_scale))
                if hasattr(module, "weight_zero_point"):
                    module.weight_zero_point.copy_(zero.view_as(module.weight_zero_point))
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(str(path))
    return path


@pytest.fixture(scope="module", params=list(SCHEMES))
def checkpoint(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, write_checkpoint(tmp_path_factory.mktemp(request.param),
                                           *SCHEMES[request.param])


def decompressed(path: Path) -> dict[str, torch.Tensor]:
    """Every quantized linear weight of the folder, as compressed-tensors decompresses it."""
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    scheme = QuantizationScheme.model_validate(quant["config_groups"]["group_0"])
    return decompress_all(load_file(str(path / "model.safetensors")), scheme)


def decompress_all(tensors: dict[str, torch.Tensor], scheme: Any) -> dict[str, torch.Tensor]:
    """Every ``pack-quantized`` layer of ``tensors`` as compressed-tensors'
    ``PackedQuantizationCompressor`` decompresses it under ``scheme`` (in float32: it computes
    in the scales' dtype, so they are widened first)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    out = {}
    for name in tensors:
        if name.endswith(".weight_packed"):
            prefix = name.removesuffix(".weight_packed")
            parts = {k.removeprefix(prefix + "."): v.float() if v.is_floating_point() else v
                     for k, v in tensors.items() if k.startswith(prefix + ".weight_")}
            weight = PackedQuantizationCompressor.decompress(parts, scheme)["weight"]
            out[f"{prefix}.weight"] = weight.float()
    return out


def test_packed_weights_arrive_as_the_values_compressed_tensors_decompresses(
        checkpoint: tuple[str, Path]) -> None:
    """Held as blocks: ``d = scale`` (a bfloat16 number, exact in float16) and ``m = -(8 +
    zero) scale``, exact for symmetric schemes (``-8 scale``, ``0``); with a zero point ``m``
    is rounded to float16, within ``2^-11 |m|``. Dense (``--quantization none``, or groups that
    are not whole blocks) in bfloat16: the values rounded once to bfloat16."""
    name, path = checkpoint
    want = decompressed(path)
    layout = LAYOUTS[name]
    source = open_weights(path, torch.bfloat16, quantized=True)
    held = dict(source)
    assert len(source) == len(held)  # the progress bar's total: one tensor per layer
    dense = dict(open_weights(path, torch.bfloat16, quantized=False))
    assert sorted(n for n in held if n in want) == sorted(want)
    assert "model.embed_tokens.weight" in held and "lm_head.weight" in held
    assert not any(n.endswith(("_packed", "_scale", "_shape", "_zero_point")) for n in held)
    symmetric = SCHEMES[name][2]
    for weight_name, reference in want.items():
        got = held[weight_name]
        if layout is None:
            assert isinstance(got, torch.Tensor)
            got = got.float()
        else:
            assert isinstance(got, QuantizedTensor) and got.layout == layout
            got = got.dequantize()
        m_bound = 0 if symmetric else 2**-11 * 23 * reference.abs().max().item()
        if layout is None:  # dense in bfloat16
            reference = reference.bfloat16().float()
        torch.testing.assert_close(got, reference, rtol=0, atol=m_bound)
        torch.testing.assert_close(dense[weight_name], reference.bfloat16(), rtol=0, atol=0)


def logits_of(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    row = runner.req_to_token_pool.alloc()
    batch = make_forward_batch(runner, ForwardMode.EXTEND, [BatchSeq(row, 0, prompt)])
    logits = runner.logits_at(runner.forward(batch), torch.arange(len(prompt)))
    release_sequence(runner, row, len(prompt))
    return logits


def test_served_logits_equal_the_decompressed_model(checkpoint: tuple[str, Path]) -> None:
    """Served with the default ``--quantization auto`` (float32 activations, every product
    exact): the linear layers are held in ``q4``/``q8`` blocks and the logits equal the tiny
    Llama's in transformers on the decompressed weights, up to the order of the sums (1e-4 on
    logits of about +-1). With zero points, each block's offset ``m`` is rounded to float16
    (the same offset on all 32 values, so it does not average out): 2e-3 (measured 7e-4)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    name, path = checkpoint
    pm = create_plugin_manager()
    served = ModelRunner(model_path=str(path), dtype="float32", int8_activations="off",
                         registries=pm.registries, plugin_manager=pm, max_total_tokens=512,
                         max_running_requests=2, show_progress=False)
    assert served.quantization == "compressed-tensors"
    layer = served.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight_layout == LAYOUTS[name]
    assert layer.mlp.down_proj.weight_layout == LAYOUTS[name]
    assert served.model.lm_head.weight_layout is None  # the ignored LM head stays dense
    if SCHEMES[name][2]:  # transformers reads the folder itself
        reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    else:
        reference = LlamaForCausalLM(load_hf_config(path)).float()
        state = dict(open_weights(path, torch.float32, quantized=False))
        reference.load_state_dict({**state, **decompressed(path)})
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = reference.eval()(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits_of(served, prompt), want, rtol=0,
                               atol=1e-4 if SCHEMES[name][2] else 2e-3)


def test_quantization_modes_of_compressed_tensors_checkpoints(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    config = LlamaConfig()
    scheme = {"format": "pack-quantized", "targets": ["Linear"], "input_activations": None,
              "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                          "symmetric": True}}
    config.quantization_config = {"quant_method": "compressed-tensors",
                                  "config_groups": {"group_0": scheme}}
    assert resolve_quantization("auto", tmp_path, config) == "compressed-tensors"
    assert resolve_quantization("compressed-tensors", tmp_path, config) == "compressed-tensors"
    assert resolve_quantization("none", tmp_path, config) == "none"
    with pytest.raises(ValueError, match="already quantized"):
        resolve_quantization("int4", tmp_path, config)
    with pytest.raises(ValueError, match="needs a compressed-tensors checkpoint"):
        resolve_quantization("compressed-tensors", tmp_path, LlamaConfig())
    with pytest.raises(ValueError, match="is a GGUF file"):
        resolve_quantization("compressed-tensors", bundled_model_path(), LlamaConfig())
    refused = {
        "quantized activations": {**scheme, "input_activations": {"num_bits": 8,
                                                                  "type": "int"}},
        "format 'float-quantized'": {**scheme, "format": "float-quantized"},
        "actorder: group": {**scheme, "weights": {**scheme["weights"], "actorder": "group"}},
        "2-bit int": {**scheme, "weights": {**scheme["weights"], "num_bits": 2}},
    }
    for what, bad in refused.items():
        config.quantization_config = {"quant_method": "compressed-tensors",
                                      "config_groups": {"group_0": bad}}
        with pytest.raises(ValueError, match=what.replace("(", r"\(")):
            resolve_quantization("auto", tmp_path, config)


@pytest.mark.slow
def test_sgl_serve_runs_a_w4a16_checkpoint(tmp_path: Path) -> None:
    """``sgl serve`` on a W4A16 folder: the start-up log and ``/get_server_info`` say
    ``compressed-tensors``, the weights take less than the dense model's, and greedy tokens
    equal transformers' on the folder (float32, exact products)."""
    from transformers import AutoModelForCausalLM

    from sgl.model_loader import load_tokenizer

    path = write_checkpoint(tmp_path / "w4a16", 4, 32, True)
    load_tokenizer(None).save_pretrained(path)  # the scheduler loads one (stop strings)
    prompt = [1, 17, 42, 99, 5, 200, 31]
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                  min_new_tokens=8)[0, len(prompt):].tolist()
    log = tmp_path / "server.log"
    info, output_ids = serve_greedy(path, prompt, log)
    assert info["quantization"] == "compressed-tensors"
    dense_bytes = sum(p.numel() * 4 for p in reference.parameters())
    assert info["weights_bytes"] < dense_bytes / 2
    assert "quantization compressed-tensors" in log.read_text()
    assert output_ids == want


def serve_greedy(path: Path, prompt: list[int], log: Path) -> tuple[dict[str, Any], list[int]]:
    """``sgl serve`` on the folder ``path`` (float32, exact products): its
    ``/get_server_info`` and 8 greedy tokens after ``prompt``; the log goes to ``log``."""
    import httpx
    from sgl_testing import ServerProcess

    server = ServerProcess("--model-path", str(path), "--dtype", "float32",
                           "--int8-activations", "off", "--max-total-tokens", "512",
                           "--context-length", "128", log_path=log)
    try:
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=30).json()
        out = httpx.post(f"{server.base_url}/generate", timeout=60, json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True}}).json()
    finally:
        server.stop()
    return info, out["output_ids"]


def test_a_qwen2_moe_checkpoint_holds_its_experts_as_blocks(tmp_path: Path) -> None:
    """A tiny Qwen2-MoE (transformers writes its experts one by one, as published MoE
    checkpoints have them) whose linear weights, experts included, compressed-tensors'
    ``PackedQuantizationCompressor`` compresses W4A16 in groups of 32, the router gates and LM
    head left dense as llm-compressor's recipes leave them: the stacked experts are held as
    ``q4`` and the logits equal transformers' on the decompressed weights."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=64, shared_expert_intermediate_size=64,
                            num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=128, tie_word_embeddings=False)
    Qwen2MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    (tmp_path / "reference").mkdir()
    (tmp_path / "reference" / "config.json").write_text((tmp_path / "config.json").read_text())
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                            group_size=32)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    ignore = ("lm_head", "mlp.gate", "shared_expert_gate")
    dense = load_file(str(tmp_path / "model.safetensors"))
    stored, decompressed_weights = {}, {}
    for name, tensor in dense.items():
        prefix = name.removesuffix(".weight")
        if tensor.dim() != 2 or "embed_tokens" in name or prefix.endswith(ignore):
            stored[name] = tensor
            continue
        grouped = tensor.float().view(tensor.shape[0], -1, 32)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        parts = PackedQuantizationCompressor.compress(
            {"weight": tensor, "weight_scale": scale.to(tensor.dtype),
             "weight_zero_point": zero}, scheme)
        stored.update({f"{prefix}.{k}": v for k, v in parts.items()})
        widened = {k: v.float() if v.is_floating_point() else v for k, v in parts.items()}
        decompressed_weights[name] = PackedQuantizationCompressor.decompress(
            widened, scheme)["weight"]
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    quant = QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore),
                               format="pack-quantized").model_dump()
    config_file = tmp_path / "config.json"
    written = json.loads(config_file.read_text())
    written["quantization_config"] = {**quant, "quant_method": "compressed-tensors"}
    config_file.write_text(json.dumps(written))

    pm = create_plugin_manager()
    served = ModelRunner(model_path=str(tmp_path), dtype="float32", int8_activations="off",
                         registries=pm.registries, plugin_manager=pm, max_total_tokens=512,
                         max_running_requests=2, show_progress=False)
    assert served.quantization == "compressed-tensors"
    moe = next(m for m in served.model.modules() if isinstance(getattr(m, "layouts", None), dict))
    assert moe.layouts == {"gate_up": "q4", "down": "q4"}
    save_file({**{k: v.float() for k, v in dense.items()}, **decompressed_weights},
              str(tmp_path / "reference" / "model.safetensors"), metadata={"format": "pt"})
    reference = Qwen2MoeForCausalLM.from_pretrained(str(tmp_path / "reference"),
                                                    dtype=torch.float32)
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = reference.eval()(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits_of(served, prompt), want, rtol=0, atol=1e-4)


def test_a_malformed_layer_is_named_at_load(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from sgl.model_loader import ModelLoadError

    path = write_checkpoint(tmp_path / "w4", 4, 32, True)
    tensors = load_file(str(path / "model.safetensors"))
    layer = "model.layers.1.mlp.up_proj"
    broken = {
        "weight_shape": {**tensors, f"{layer}.weight_shape": torch.tensor([256, 96])},
        "weight_scale": {k: v for k, v in tensors.items() if k != f"{layer}.weight_scale"},
    }
    for what, stored in broken.items():
        save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=f"{layer}: weight_.*"
                           + ("4- or 8-bit packing" if what == "weight_shape"
                              else "without weight_scale")):
            dict(open_weights(path, torch.float32, quantized=True))
