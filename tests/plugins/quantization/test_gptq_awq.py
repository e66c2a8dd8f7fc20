"""GPTQ and AWQ checkpoints (AutoGPTQ/GPTQModel's and AutoAWQ's own formats) served as the blocks
of sgl's quantized kernels.

The checkpoints are tiny random Llamas whose linear weights this file quantizes per group (as
AutoGPTQ's quantizer picks scales and zeros, float16 scales) and packs by the formats' rules
(:func:`pack_gptq`, :func:`pack_awq`); the embedding and LM head stay dense in bfloat16, as those
tools leave them. The reference values are the integers, scales and zeros before packing. For
AWQ a real reader of the format checks the packing too: compressed-tensors' ``AutoAWQConverter``
(written by vLLM's team) converts the same tensors, and its ``PackedQuantizationCompressor``
decompresses them. ``benchmarks/gptq_awq_vs_vllm.py`` checks both formats against vLLM itself
(not here: vLLM is not installed in CI).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from sgl.engine.model_runner import ModelRunner, resolve_quantization
from sgl.layers.quantized import QuantizedTensor
from sgl.model_loader import ModelLoadError, bundled_model_path, load_hf_config, open_weights
from sgl.plugins import create_plugin_manager

from test_compressed_tensors import decompress_all, logits_of, serve_greedy, tiny_llama

#: the columns of 8 consecutive outputs in the nibbles of an AWQ word: nibble j holds column
#: AWQ_ORDER[j] (AutoAWQ's ``order_map``)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
#: the quantized projections of the tiny Llama
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Layer:
    """A quantized weight ``[N, K]`` before packing: ``q`` and ``zero`` unsigned integers, one
    float16 ``scale`` and ``zero`` per row and group of ``K / G`` columns."""

    q: torch.Tensor  # [N, K]
    scale: torch.Tensor  # [N, G]
    zero: torch.Tensor  # [N, G]
    bits: int

    def expand(self, per_group: torch.Tensor) -> torch.Tensor:
        return per_group.repeat_interleave(self.q.shape[1] // per_group.shape[1], dim=1)

    def values(self) -> torch.Tensor:
        """``W = (q - zero) * scale`` in float32 (exact: at most 9-bit integers times float16)."""
        return (self.q - self.expand(self.zero)).float() * self.expand(self.scale).float()

    def offset(self) -> torch.Tensor:
        """``|m|`` of each value's block, ``|(zero - mid) scale|`` (``mid`` the integer a ``q8``
        block holds as 0), which sgl rounds to float16."""
        mid = 0 if self.bits == 4 else 128
        return (self.expand(self.zero - mid).float() * self.expand(self.scale).float()).abs()


def quantize(weight: torch.Tensor, bits: int, group: int, symmetric: bool) -> Layer:
    """``weight [N, K]`` rounded per group of ``group`` columns (-1: per row) as AutoGPTQ's
    quantizer does: symmetric over ``[-amax, amax]`` with the zero in the middle, else over
    ``[min(w, 0), max(w, 0)]``. The asymmetric zeros of the first two rows' first group are set
    to 0 and ``2^bits - 1``, so that GPTQ v1 stores a zero of 0 as ``-1`` (wrapped)."""
    rows, cols = weight.shape
    group = cols if group == -1 else group
    w = weight.float().view(rows, cols // group, group)
    maxq = 2**bits - 1
    if symmetric:
        scale = (2 * w.abs().amax(-1) / maxq).clamp(min=1e-5)
        zero = torch.full(scale.shape, (maxq + 1) // 2, dtype=torch.int64)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp(min=1e-5)
        zero = torch.round(-lo / scale).long().clamp(0, maxq)
        zero[0, 0], zero[1, 0] = 0, maxq
    scale = scale.half()
    q = torch.round(w / scale.float()[..., None]).long() + zero[..., None]
    return Layer(q.clamp(0, maxq).view(rows, cols), scale, zero, bits)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words of the unsigned ``values [R, C]`` packed along each row: value ``i`` at bits
    ``(i % (32 / bits)) * bits`` of word ``i // (32 / bits)``."""
    per_word = 32 // bits
    grouped = values.long().reshape(values.shape[0], -1, per_word)
    words = sum(grouped[..., i] << (bits * i) for i in range(per_word))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def pack_gptq(layer: Layer, *, v1: bool) -> dict[str, torch.Tensor]:
    """``qweight`` (along K), ``qzeros`` (along N; v1: zero minus one, wrapped to ``bits``),
    ``scales`` and the trivial ``g_idx`` AutoGPTQ writes with them."""
    cols = layer.q.shape[1]
    zero = (layer.zero - 1) % 2**layer.bits if v1 else layer.zero
    group = cols // layer.scale.shape[1]
    return {"qweight": pack(layer.q, layer.bits).t().contiguous(),
            "qzeros": pack(zero.t(), layer.bits), "scales": layer.scale.t().contiguous(),
            "g_idx": (torch.arange(cols) // group).to(torch.int32)}


def pack_awq(layer: Layer, *, zero_point: bool) -> dict[str, torch.Tensor]:
    """``qweight`` ``[K, N/8]`` and ``qzeros`` ``[G, N/8]``, packed along N with the columns of
    each word in :data:`AWQ_ORDER`, and ``scales``."""
    def interleave(values: torch.Tensor) -> torch.Tensor:  # [R, N], columns -> word order
        rows, cols = values.shape
        return values.reshape(rows, cols // 8, 8)[:, :, AWQ_ORDER].reshape(rows, cols)

    parts = {"qweight": pack(interleave(layer.q.t()), 4),
             "scales": layer.scale.t().contiguous()}
    if zero_point:
        parts["qzeros"] = pack(interleave(layer.zero.t()), 4)
    return parts


def write_checkpoint(path: Path, quant: dict[str, Any], *, group: int, symmetric: bool,
                     skip: tuple[str, ...] = ()) -> dict[str, Layer]:
    """The tiny Llama with its projections (but those named in ``skip``) quantized and packed
    as ``quant`` (a GPTQ or AWQ ``quantization_config``) says; the layers by weight name."""
    from safetensors.torch import load_file, save_file

    tiny_llama().save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    awq = quant["quant_method"] == "awq"
    bits = quant["bits"]
    stored, layers = {}, {}
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if not prefix.endswith(PROJECTIONS) or prefix.endswith(skip):
            stored[name] = tensor
            continue
        layer = layers[name] = quantize(tensor, bits, group, symmetric)
        parts = (pack_awq(layer, zero_point=quant.get("zero_point", True)) if awq else
                 pack_gptq(layer, v1=quant.get("checkpoint_format", "gptq") == "gptq"))
        stored.update({f"{prefix}.{part}": value for part, value in parts.items()})
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return layers


def gptq_config(bits: int, group: int, symmetric: bool, **extra: Any) -> dict[str, Any]:
    """A ``quantization_config`` as transformers' ``GPTQConfig`` writes it."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False,
            "sym": symmetric, "true_sequential": True, "damp_percent": 0.01,
            "static_groups": False, "checkpoint_format": "gptq", **extra}


def awq_config(group: int, **extra: Any) -> dict[str, Any]:
    """A ``quantization_config`` as AutoAWQ writes it."""
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None, **extra}


#: GPTQ checkpoints tested: (bits, group size, symmetric, extra config), and the layout sgl holds
#: them in (None: dense)
GPTQ_SCHEMES = {
    "w4-g32-sym": (4, 32, True, {}, "q4"),
    "w4-g128-asym": (4, 128, False, {}, "q4"),
    "w4-g128-asym-v2": (4, 128, False, {"checkpoint_format": "gptq_v2"}, "q4"),
    "w4-g32-desc-act": (4, 32, True, {"desc_act": True, "static_groups": True}, "q4"),
    "w8-channel-sym": (8, -1, True, {}, "q8"),
    "w8-g64-asym-v2": (8, 64, False, {"checkpoint_format": "gptq_v2"}, "q8"),
    "w4-g16-sym": (4, 16, True, {}, None),
}
#: AWQ checkpoints tested: (group size, extra config); the skipped projection stays dense
AWQ_SCHEMES = {
    "g32": (32, {}),
    "g128": (128, {}),
    "g64-no-zero-point": (64, {"zero_point": False}),
    "g32-down-not-converted": (32, {"modules_to_not_convert": ["down_proj"]}),
}


@dataclass
class Checkpoint:
    name: str
    path: Path
    layers: dict[str, Layer]
    symmetric: bool
    layout: str | None


@pytest.fixture(scope="module", params=list(GPTQ_SCHEMES))
def gptq(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    bits, group, symmetric, extra, layout = GPTQ_SCHEMES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    layers = write_checkpoint(path, gptq_config(bits, group, symmetric, **extra), group=group,
                              symmetric=symmetric)
    return Checkpoint(request.param, path, layers, symmetric, layout)


@pytest.fixture(scope="module", params=list(AWQ_SCHEMES))
def awq(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    group, extra = AWQ_SCHEMES[request.param]
    quant = awq_config(group, **extra)
    path = tmp_path_factory.mktemp(request.param)
    skip = tuple(quant["modules_to_not_convert"] or ())
    layers = write_checkpoint(path, quant, group=group, symmetric=not quant["zero_point"],
                              skip=skip)
    return Checkpoint(request.param, path, layers, not quant["zero_point"], "q4")


def check_held(checkpoint: Checkpoint, reference: dict[str, torch.Tensor]) -> None:
    """The folder's weights, read quantized and dense, against ``reference`` (float32 values of
    every quantized weight): blocks exact for symmetric schemes (``d = scale``, ``m = -8 d`` or
    0), else within ``2^-11 |m|`` (``m`` rounded to float16) plus float32's rounding of
    ``q d + m``; dense (``--quantization none``) the values rounded once to bfloat16."""
    source = open_weights(checkpoint.path, torch.bfloat16, quantized=True)
    held = dict(source)
    assert len(source) == len(held)  # the progress bar's total: one tensor per layer
    dense = dict(open_weights(checkpoint.path, torch.bfloat16, quantized=False))
    assert not any(n.endswith((".qweight", ".qzeros", ".scales", ".g_idx")) for n in held)
    assert "model.embed_tokens.weight" in held and "lm_head.weight" in held
    assert held.keys() == dense.keys() and set(reference) < set(held)
    for name, want in reference.items():
        got = held[name]
        if checkpoint.layout is None:
            assert isinstance(got, torch.Tensor)
            torch.testing.assert_close(got, want.bfloat16(), rtol=0, atol=0)
        else:
            assert isinstance(got, QuantizedTensor) and got.layout == checkpoint.layout
            got = got.dequantize()
            if checkpoint.symmetric:
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            else:
                bound = 2**-11 * checkpoint.layers[name].offset() + 2**-23 * want.abs()
                assert ((got - want).abs() <= bound).all(), name
        torch.testing.assert_close(dense[name], want.bfloat16(), rtol=0, atol=0)


def check_served(checkpoint: Checkpoint, method: str,
                 reference: dict[str, torch.Tensor]) -> None:
    """Served with the default ``--quantization auto`` (float32 activations, every product
    exact): the projections held as blocks, the LM head dense, and the logits those of
    transformers' Llama on the ``reference`` weights, up to the order of the sums (1e-4 on
    logits of about +-1); with zero points each block's ``m`` is rounded to float16: 2e-3."""
    from transformers import LlamaForCausalLM

    pm = create_plugin_manager()
    served = ModelRunner(model_path=str(checkpoint.path), dtype="float32",
                         int8_activations="off", registries=pm.registries, plugin_manager=pm,
                         max_total_tokens=512, max_running_requests=2, show_progress=False)
    assert served.quantization == method
    layer = served.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight_layout == checkpoint.layout
    down = "model.layers.0.mlp.down_proj.weight"
    assert layer.mlp.down_proj.weight_layout == (checkpoint.layout if down in reference else None)
    assert served.model.lm_head.weight_layout is None
    model = LlamaForCausalLM(load_hf_config(checkpoint.path)).float()
    state = dict(open_weights(checkpoint.path, torch.float32, quantized=False))
    model.load_state_dict({**state, **reference})
    prompt = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = model.eval()(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits_of(served, prompt), want, rtol=0,
                               atol=1e-4 if checkpoint.symmetric else 2e-3)


# -- GPTQ --------------------------------------------------------------------------------------

def test_gptq_weights_arrive_as_the_values_they_pack(gptq: Checkpoint) -> None:
    check_held(gptq, {name: layer.values() for name, layer in gptq.layers.items()})


def test_served_gptq_logits_equal_the_dequantized_model(gptq: Checkpoint) -> None:
    check_served(gptq, "gptq", {name: layer.values() for name, layer in gptq.layers.items()})


@pytest.mark.parametrize("file, quant", [
    ("quantize_config.json", {"bits": 4, "group_size": 32, "desc_act": False, "sym": False}),
    ("quant_config.json", {"zero_point": True, "q_group_size": 32, "w_bit": 4,
                           "version": "GEMM"}),
])
def test_older_checkpoints_keep_their_settings_in_their_own_file(
        tmp_path: Path, file: str, quant: dict[str, Any]) -> None:
    """AutoGPTQ's older checkpoints keep their settings only in ``quantize_config.json`` and
    AutoAWQ's in ``quant_config.json`` (under their own key names), with no
    ``quantization_config`` in ``config.json``: they are read from there, as vLLM does."""
    method = "awq" if file == "quant_config.json" else "gptq"
    config = awq_config(32) if method == "awq" else gptq_config(4, 32, False)
    layers = write_checkpoint(tmp_path, config, group=32, symmetric=False)
    written = json.loads((tmp_path / "config.json").read_text())
    del written["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(written))
    (tmp_path / file).write_text(json.dumps(quant))
    checkpoint = Checkpoint(file, tmp_path, layers, False, "q4")
    check_served(checkpoint, method, {name: layer.values() for name, layer in layers.items()})


def test_act_order_groups_are_refused_with_the_layer(tmp_path: Path) -> None:
    """``desc_act`` without static groups stores a ``g_idx`` that is not ``k // group_size``:
    sgl's blocks need each group's columns together, so the layer is named and refused."""
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path, gptq_config(4, 32, True, desc_act=True), group=32,
                     symmetric=True)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    layer = "model.layers.1.self_attn.o_proj"
    tensors[f"{layer}.g_idx"] = (torch.arange(128) % 4).to(torch.int32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=f"{layer}: act-order groups are not supported"):
        dict(open_weights(tmp_path, torch.float32, quantized=True))


def test_a_malformed_layer_is_named_at_load(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path, gptq_config(4, 32, False), group=32, symmetric=False)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    layer = "model.layers.0.mlp.up_proj"
    broken = {
        "scales": ({**tensors, f"{layer}.scales": tensors[f"{layer}.scales"][:2]},
                   "scales \\[2, 256\\] are not \\[4, 256\\]"),
        "qzeros": ({k: v for k, v in tensors.items() if k != f"{layer}.qzeros"},
                   "qzeros must be int32 \\[4, 32\\], got none"),
    }
    for stored, message in broken.values():
        save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=f"{layer}: {message}"):
            dict(open_weights(tmp_path, torch.float32, quantized=True))


# -- AWQ against compressed-tensors' AutoAWQ converter -----------------------------------------

def converted(path: Path) -> dict[str, torch.Tensor]:
    """Every quantized weight of the AWQ folder as compressed-tensors reads it: its
    ``AutoAWQConverter`` turns the tensors into ``pack-quantized`` ones, which its
    ``PackedQuantizationCompressor`` decompresses."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from safetensors.torch import load_file

    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    converter = AutoAWQConverter.from_autoawq_config(quant)
    tensors = converter.process(load_file(str(path / "model.safetensors")))
    return decompress_all(tensors, converter.update_config(None).config_groups["config_group_0"])


def test_awq_packing_reads_as_compressed_tensors_reads_it(awq: Checkpoint) -> None:
    """The converter finds the values this file packed (so the packer follows AutoAWQ's
    interleaving as vLLM's team reads it), and sgl holds them: exact without zero points,
    within ``2^-11 |m|`` with."""
    reference = converted(awq.path)
    assert sorted(reference) == sorted(awq.layers)
    for name, layer in awq.layers.items():
        torch.testing.assert_close(reference[name], layer.values(), rtol=0, atol=0)
    check_held(awq, reference)


def test_served_awq_logits_equal_the_converted_model(awq: Checkpoint) -> None:
    check_served(awq, "awq", converted(awq.path))


# -- the modes and what is refused -------------------------------------------------------------

def test_quantization_modes_of_gptq_and_awq_checkpoints(tmp_path: Path) -> None:
    from transformers import LlamaConfig

    def config(quant: dict[str, Any]) -> LlamaConfig:
        made = LlamaConfig()
        made.quantization_config = quant
        return made

    gptq, awq = config(gptq_config(4, 128, True)), config(awq_config(128))
    assert resolve_quantization("auto", tmp_path, gptq) == "gptq"
    assert resolve_quantization("gptq", tmp_path, gptq) == "gptq"
    assert resolve_quantization("none", tmp_path, gptq) == "none"
    assert resolve_quantization("auto", tmp_path, awq) == "awq"
    assert resolve_quantization("awq", tmp_path, awq) == "awq"
    with pytest.raises(ValueError, match=r"--quantization int4 .* already quantized \(gptq\)"):
        resolve_quantization("int4", tmp_path, gptq)
    with pytest.raises(ValueError, match=r"--quantization int8 .* already quantized \(awq\)"):
        resolve_quantization("int8", tmp_path, awq)
    with pytest.raises(ValueError, match="--quantization gptq needs a GPTQ checkpoint; "
                                         f"{tmp_path.name} is dense"):
        resolve_quantization("gptq", tmp_path, LlamaConfig())
    with pytest.raises(ValueError, match="--quantization awq needs an AWQ checkpoint; "
                                         f"{tmp_path.name} is a GPTQ checkpoint"):
        resolve_quantization("awq", tmp_path, gptq)
    with pytest.raises(ValueError, match="--quantization compressed-tensors needs a "
                                         "compressed-tensors checkpoint; .* is an AWQ"):
        resolve_quantization("compressed-tensors", tmp_path, awq)
    with pytest.raises(ValueError, match="--quantization gptq needs a GPTQ checkpoint; .* is "
                                         "a GGUF file"):
        resolve_quantization("gptq", bundled_model_path(), LlamaConfig())
    refused = {
        "GPTQ checkpoint of 3-bit weights; .*2- and 3-bit ones are not supported":
            gptq_config(3, 128, True),
        "GPTQ checkpoint of 2-bit weights": gptq_config(2, 128, True),
        "in the 'marlin' format; sgl reads the gptq and gptq_v2 formats":
            gptq_config(4, 128, True, checkpoint_format="marlin"),
        "per-module overrides": gptq_config(4, 128, True, dynamic={"-:.*down_proj": {}}),
        "AWQ checkpoint of version 'gemv'; sgl runs AutoAWQ's gemm version":
            awq_config(128, version="gemv"),
        "AWQ checkpoint of version 'gemv_fast'": awq_config(128, version="GEMV_FAST"),
        "AWQ checkpoint of 8-bit weights": awq_config(128, bits=8),
        "group_size 0": gptq_config(4, 0, True),
    }
    for message, quant in refused.items():
        with pytest.raises(ValueError, match=message):
            resolve_quantization("auto", tmp_path, config(quant))


@pytest.mark.slow
def test_sgl_serve_runs_a_gptq_checkpoint(tmp_path: Path) -> None:
    """``sgl serve`` on a 4-bit GPTQ folder: ``/get_server_info`` and the start-up log say
    ``gptq``, the weights take less than half the dense model's, and the greedy tokens equal
    transformers' on the dequantized weights (float32, exact products)."""
    from transformers import LlamaForCausalLM

    from sgl.model_loader import load_tokenizer

    path = tmp_path / "gptq"
    layers = write_checkpoint(path, gptq_config(4, 32, True), group=32, symmetric=True)
    load_tokenizer(None).save_pretrained(path)  # the scheduler loads one (stop strings)
    reference = LlamaForCausalLM(load_hf_config(path)).float()
    state = dict(open_weights(path, torch.float32, quantized=False))
    reference.load_state_dict({**state, **{n: layer.values() for n, layer in layers.items()}})
    prompt = [1, 17, 42, 99, 5, 200, 31]
    with torch.no_grad():
        want = reference.eval().generate(torch.tensor([prompt]), max_new_tokens=8,
                                         do_sample=False, min_new_tokens=8)[0, len(prompt):]
    info, output_ids = serve_greedy(path, prompt, tmp_path / "server.log")
    assert info["quantization"] == "gptq"
    dense_bytes = sum(p.numel() * 4 for p in reference.parameters())
    assert info["weights_bytes"] < dense_bytes / 2
    assert "quantization gptq" in (tmp_path / "server.log").read_text()
    assert output_ids == want.tolist()
