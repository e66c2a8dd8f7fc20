"""Writing a transformers model as a GGUF file the way llama.cpp's ``convert_hf_to_gguf.py``
does (then ``llama-quantize``), for the GGUF tests of the model families.

Names come from gguf-py's own ``TensorNameMap`` (the converter's), not from sgl's tables. The
converter's transforms are applied: ``llama`` q/k rows permuted (``LlamaModel.permute``), 1 added
to Gemma's norm weights, Qwen2-MoE experts split into gate/up/down stacks and the shared-expert
gate squeezed to a vector, Llama 3 rope scaling written as ``rope_freqs`` and Phi-3's LongRoPE
factors as ``rope_factors_long/short``. Vectors stay F32 and the MoE router F32 (as
``llama-quantize`` keeps them); the other tensors are ``qtype``, except that a ``Q4_0`` file
keeps ``token_embd`` in ``Q8_0`` (a mix of layouts, as in real files) and a ``Q6_K`` file
writes tensors whose rows are not whole 256-value super-blocks as ``Q8_0`` (as
``llama-quantize`` falls back). gguf-py cannot quantize K-quants: :func:`_quantize_q6_k` writes
Q6_K bytes (a plain rounding, not llama.cpp's search; gguf-py's dequantization gives the values
they hold). Not a test module.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["GGUF_NAMES", "write_gguf"]

#: transformers model_type -> llama.cpp architecture
GGUF_NAMES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen2_moe": "qwen2moe",
              "qwen3": "qwen3", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}


def _qtype(name: str) -> Any:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


def _quantize_q6_k(array: np.ndarray) -> np.ndarray:
    """Q6_K bytes of float ``array [rows, cols]`` (cols a multiple of 256): per 16 values a
    scale ``amax / 31``, stored as int8 ``s`` times the super-block's float16 ``d = max / 127``,
    and ``q = round(x / (d s)) + 32`` in 0..63; llama.cpp's byte order (``block_q6_K``)."""
    rows, cols = array.shape
    x = array.astype(np.float32).reshape(-1, 16, 16)  # [super-blocks, 16 sub-blocks, 16]
    sub = np.abs(x).max(-1) / 31
    d = (sub.max(-1, keepdims=True) / 127).astype(np.float16)
    df = d.astype(np.float32)
    s = np.where(df > 0, np.round(sub / np.where(df > 0, df, 1)), 0).clip(-128, 127)
    step = (df * s)[..., None]
    q = (np.where(step > 0, np.round(x / np.where(step > 0, step, 1)), 0).clip(-32, 31) + 32)
    q = q.astype(np.uint8).reshape(-1, 2, 128)  # two halves of 128 values
    ql = (q[..., :64] & 0x0F) | ((q[..., 64:] & 0x0F) << 4)  # value l low, l + 64 high
    qh = sum((q[..., 32 * t:32 * t + 32] >> 4) << (2 * t) for t in range(4))  # l % 32, bits 2t
    blocks = np.concatenate([ql.reshape(-1, 128), qh.astype(np.uint8).reshape(-1, 64),
                             s.astype(np.int8).view(np.uint8), d.view(np.uint8)], axis=-1)
    return blocks.reshape(rows, cols // 256 * 210)


def _round_trip(array: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``(bytes or floats to write, the float32 values they hold)``."""
    from gguf.quants import dequantize, quantize

    if qtype == "F32":
        return array, array
    if qtype == "F16":
        half = array.astype(np.float16)
        return half, half.astype(np.float32)
    data = _quantize_q6_k(array) if qtype == "Q6_K" else quantize(array, _qtype(qtype))
    return data, dequantize(data, _qtype(qtype)).reshape(array.shape).astype(np.float32)


def _permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """The converter's ``LlamaModel.permute`` (``n_head``: the kv heads for k)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _rope(config: Any, layer_type: str = "full_attention") -> dict[str, Any]:
    params = dict(config.rope_parameters)
    return dict(params.get(layer_type) or params) if "full_attention" in params else params


def _llama3_factors(config: Any, dim: int) -> torch.Tensor:
    """The converter's ``rope_freqs`` for ``rope_type: llama3`` (``LlamaModel``)."""
    rope = _rope(config)
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _hf_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors, a tied LM head left out (as in the safetensors files)."""
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _to_gguf(arch: str, config: Any, name: str, tensor: torch.Tensor) -> list[tuple[str, Any]]:
    """The converter's ``modify_tensors``: (HF-style name, tensor) pairs to map and write."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        return [(name, _permute(tensor, heads))]
    if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        return [(name, _permute(tensor, kv))]
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        return [(name, tensor + 1)]
    if arch == "qwen2moe" and name.endswith("mlp.experts.gate_up_proj"):
        base = name.removesuffix(".gate_up_proj")
        gate, up = tensor.chunk(2, dim=-2)
        return [(f"{base}.gate_proj.weight", gate), (f"{base}.up_proj.weight", up)]
    if arch == "qwen2moe" and name.endswith("mlp.experts.down_proj"):
        return [(f"{name}.weight", tensor)]
    if name.endswith("shared_expert_gate.weight"):
        return [(name, tensor.squeeze(0))]
    return [(name, tensor)]


def _metadata(writer: Any, arch: str, model: Any, vocab: int, title: str) -> None:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(title)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = _rope(config)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(_scaling("LINEAR"))
        writer.add_rope_scaling_factor(rope["factor"])
    if arch in ("qwen3", "gemma2", "gemma3"):  # configs with an explicit head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_vocab_size(vocab)
        writer.add_rope_dimension_count(head_dim)
    if arch == "qwen2moe":
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_rope_freq_base_swa(_rope(config, "sliding_attention")["rope_theta"])
    if arch == "phi3":
        rotary = int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size) \
            // config.num_attention_heads
        writer.add_rope_dimension_count(rotary)
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings")
                                             or config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            writer.add_rope_scaling_type(_scaling("LONGROPE"))
            scale = config.max_position_embeddings / rope["original_max_position_embeddings"]
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"]))
                if scale > 1 else 1.0)
    # a vocabulary, as files have (transformers reads vocab_size from it where no key says)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _scaling(name: str) -> Any:
    from gguf import RopeScalingType

    return RopeScalingType[name]


def write_gguf(model: Any, path: Path, qtype: str, *, title: str = "tiny") -> dict[str, Any]:
    """Write ``model`` (a transformers causal LM) to ``path`` with 2-D tensors in ``qtype``
    (``F32``, ``F16``, ``Q8_0``, ``Q4_0`` or ``Q6_K``); ``title`` is ``general.name`` (transformers reads
    a ``llama`` file as Mistral when it holds "mistral").

    :returns: the state dict the file holds, under the model's own names and layout (what the
        reference must be given to compute with the file's values).
    """
    import gguf

    config = model.config
    arch = GGUF_NAMES[config.model_type]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    state = _hf_tensors(model)
    _metadata(writer, arch, model, state["model.embed_tokens.weight"].shape[0], title)

    reference: dict[str, torch.Tensor] = {}
    for hf_name, tensor in state.items():
        keep = "F32" if tensor.dim() < 2 or hf_name.endswith(("mlp.gate.weight",
                                                               "shared_expert_gate.weight")) \
            else "Q8_0" if (qtype == "Q4_0" and "embed_tokens" in hf_name) \
            or (qtype == "Q6_K" and tensor.shape[-1] % 256) else qtype
        _, values = _round_trip(tensor.numpy(), keep)
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(values))
        for name, part in _to_gguf(arch, config, hf_name, tensor):
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise KeyError(f"gguf-py maps no {arch} tensor to {name}")
            data, held = _round_trip(part.contiguous().numpy(), keep)
            # the file's values are the converted reference's: rounding moves with the rows
            expected = _to_gguf(arch, config, hf_name, reference[hf_name])
            want = dict(expected)[name]
            if not np.array_equal(held, want.numpy()):
                raise AssertionError(f"{gguf_name}: rounding does not commute with the converter")
            raw = None if keep in ("F32", "F16") else _qtype(keep)
            writer.add_tensor(gguf_name, data, raw_dtype=raw)
    rope = _rope(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "llama" and rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(config, head_dim).numpy())
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.asarray(rope[f"{kind}_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference
