"""The GGUF architectures sgl loads, and how each one's tensors turn back into those of the
Hugging Face checkpoint: llama.cpp's tensor names and what its converter
(``convert_hf_to_gguf.py``) did to them. The config side is :mod:`sgl.model_loader.gguf_config`.

============  =====================================  ==========================================
GGUF          Hugging Face architecture              what the converter did
============  =====================================  ==========================================
``llama``     ``LlamaForCausalLM``, ``Mistral...``   q/k rows interleaved per head
                                                     (``LlamaModel.permute``)
``qwen2``     ``Qwen2ForCausalLM``                   nothing
``qwen2moe``  ``Qwen2MoeForCausalLM``                experts stacked ``[E, ff, hidden]``, the
                                                     shared-expert gate stored as a vector
``qwen3``     ``Qwen3ForCausalLM``                   nothing
``gemma2``    ``Gemma2ForCausalLM``                  1 added to every ``*norm.weight``
``gemma3``    ``Gemma3ForCausalLM``                  1 added to every ``*norm.weight``
``phi3``      ``Phi3ForCausalLM``                    q/k/v fused (``attn_qkv``), gate/up fused
                                                     (``ffn_up``)
============  =====================================  ==========================================

Only ``llama`` (Llama, and Mistral converted as Llama) has permuted q/k rows: the converter's
Qwen, Gemma and Phi-3 classes write them as they are. Tensors the converter derives from the
config (``rope_freqs``, ``rope_factors_long``/``short``) go back into the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import accumulate

from sgl.model_loader.errors import ModelLoadError

__all__ = ["GGUF_ARCHS", "GGUFArch", "Piece", "gguf_arch"]

#: (Hugging Face name, first row, number of rows) of a GGUF tensor viewed as ``[-1, last dim]``
Piece = tuple[str, int, int]

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
#: tensors llama.cpp derives from the config; they go back into the config, not the model
CONFIG_TENSORS = frozenset({"rope_freqs", "rope_factors_long", "rope_factors_short"})

_LLAMA_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 2/3 have four norms a layer; ffn_norm is the one before the MLP
_GEMMA_LAYER = {**_LLAMA_LAYER, "ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_QWEN2MOE_LAYER = {**_LLAMA_LAYER, "ffn_gate_inp": "mlp.gate",
                   "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                   "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                   "ffn_up_shexp": "mlp.shared_expert.up_proj",
                   "ffn_down_shexp": "mlp.shared_expert.down_proj"}
_PHI3_LAYER = {k: v for k, v in _LLAMA_LAYER.items() if k != "ffn_up"}


@dataclass(frozen=True)
class GGUFArch:
    """One ``general.architecture`` of GGUF files and how its tensors turn back into Hugging
    Face ones."""

    name: str
    #: per-layer GGUF tensor kind (``blk.N.<kind>.weight``) -> module under ``model.layers.N.``
    layer_names: Mapping[str, str]
    #: fused GGUF tensors split by rows: kind -> modules in row order (three: q/k/v by head
    #: counts; two: equal halves)
    fused: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: stacked experts ``[E, rows, cols]``: kind -> projection of ``mlp.experts.<e>.``
    experts: Mapping[str, str] = field(default_factory=dict)
    #: modules stored as a vector whose Hugging Face weight is one row
    row_vectors: frozenset[str] = frozenset()
    #: llama.cpp's converter interleaved the rows of q and k within each head
    permuted_qk: bool = False
    #: the converter added this to every ``*norm.weight`` (Gemma's RMSNorm scales by 1 + w)
    norm_shift: float = 0.0

    def kinds(self) -> list[str]:
        """Every tensor name this architecture knows, for error messages."""
        layer = [*self.layer_names, *self.fused, *self.experts]
        return sorted(GLOBAL_NAMES) + sorted(f"blk.N.{k}" for k in layer)

    def hf_name(self, name: str) -> str | None:
        """The Hugging Face name of GGUF tensor ``name`` when it is one tensor there; None for
        names this architecture does not know and for fused, stacked and config tensors."""
        parts = name.split(".")
        if len(parts) == 2 and parts[0] in GLOBAL_NAMES:
            return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() \
                and parts[2] in self.layer_names:
            return f"model.layers.{parts[1]}.{self.layer_names[parts[2]]}.{parts[3]}"
        return None

    def pieces(self, name: str, shape: tuple[int, ...], heads: int,
               kv_heads: int) -> list[Piece] | None:
        """The Hugging Face tensors in GGUF tensor ``name`` of (torch-order) ``shape``; None
        when this architecture has no such tensor. :data:`CONFIG_TENSORS` give none."""
        single = self.hf_name(name)
        if single is not None:
            return [(single, 0, shape[0])]
        parts = name.split(".")
        if len(parts) == 2 and parts[0] in CONFIG_TENSORS:
            return []
        if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
            return None
        prefix, kind, suffix = f"model.layers.{parts[1]}", parts[2], parts[3]
        if kind in self.fused:
            modules = self.fused[kind]
            rows = shape[0]
            if len(modules) == 3:  # q, k, v
                head_dim, rest = divmod(rows, heads + 2 * kv_heads)
                sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
            else:  # equal parts
                part, rest = divmod(rows, len(modules))
                sizes = [part] * len(modules)
            if rest:
                raise ModelLoadError(f"GGUF tensor {name!r} has {rows} rows, which do not split "
                                     f"into {', '.join(modules)}")
            starts = accumulate(sizes[:-1], initial=0)
            return [(f"{prefix}.{m}.{suffix}", s, n) for m, s, n in zip(modules, starts, sizes)]
        if kind in self.experts and len(shape) == 3:
            count, rows = shape[0], shape[1]
            return [(f"{prefix}.mlp.experts.{e}.{self.experts[kind]}.{suffix}", e * rows, rows)
                    for e in range(count)]
        return None


GGUF_ARCHS: dict[str, GGUFArch] = {arch.name: arch for arch in (
    GGUFArch("llama", _LLAMA_LAYER, permuted_qk=True),
    GGUFArch("qwen2", _LLAMA_LAYER),
    GGUFArch("qwen2moe", _QWEN2MOE_LAYER,
             experts={"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                      "ffn_down_exps": "down_proj"},
             row_vectors=frozenset({"mlp.shared_expert_gate"})),
    GGUFArch("qwen3", _LLAMA_LAYER),
    GGUFArch("gemma2", _GEMMA_LAYER, norm_shift=1.0),
    GGUFArch("gemma3", _GEMMA_LAYER, norm_shift=1.0),
    GGUFArch("phi3", _PHI3_LAYER,
             fused={"attn_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                    "ffn_up": ("mlp.gate_proj", "mlp.up_proj")}),
)}


def gguf_arch(name: str, path: object = None) -> GGUFArch:
    """The rules of GGUF architecture ``name``.

    :raises ModelLoadError: naming the architecture and the supported ones."""
    arch = GGUF_ARCHS.get(name)
    if arch is None:
        where = f"GGUF file {str(path)!r} has" if path is not None else "GGUF"
        raise ModelLoadError(f"{where} architecture {name!r}, which sgl does not load; supported "
                             f"GGUF architectures: {', '.join(GGUF_ARCHS)}")
    return arch
