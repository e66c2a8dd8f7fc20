"""How a GGUF architecture's tensors turn back into those of the Hugging Face checkpoint:
llama.cpp's tensor names and what its converter (``convert_hf_to_gguf.py``) did to them, one
:class:`GGUFArch` per ``general.architecture``. The core holds the contract and the names every
decoder shares; model plugins register their architectures with ``sgl_register_gguf_archs``
(docs/hooks.md), each with its quirks: interleaved q/k rows, a shift of the norms, fused or
stacked tensors, and what its config needs beyond transformers' reading
(:attr:`GGUFArch.complete_config`). The config side is :mod:`sgl.model_loader.gguf_config`.

Tensors the converter derives from the config (``rope_freqs``, ``rope_factors_long``/``short``)
go back into the config.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from sgl.model_loader.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.model_loader.gguf_config import GGUFMetadata

__all__ = ["CONFIG_TENSORS", "DECODER_LAYER_NAMES", "GLOBAL_NAMES", "GGUFArch", "Piece",
           "gguf_arch", "gguf_archs_of", "installed_gguf_archs"]

#: (Hugging Face name, first row, number of rows) of a GGUF tensor viewed as ``[-1, last dim]``
Piece = tuple[str, int, int]

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
#: tensors llama.cpp derives from the config; they go back into the config, not the model
CONFIG_TENSORS = frozenset({"rope_freqs", "rope_factors_long", "rope_factors_short"})

#: the per-layer tensors of a decoder as llama.cpp and Hugging Face name them, for the
#: architectures whose converter renames nothing else
DECODER_LAYER_NAMES = {
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
    #: the converter added this to every ``*norm.weight`` (for an RMSNorm that scales by 1 + w)
    norm_shift: float = 0.0
    #: the architecture's attention biases are not optional: transformers' config says
    #: whether there are any (else: there are where the file has ``attn_q.bias`` tensors)
    fixed_attention_bias: bool = False
    #: what this architecture's config needs beyond transformers' reading and the fields every
    #: architecture gets (:meth:`complete`):
    #: ``complete_config(meta, config)`` sets them on ``config``
    complete_config: Callable[[GGUFMetadata, PretrainedConfig], None] | None = None
    #: pre-tokenizers of this architecture's files that transformers does not rebuild:
    #: ``tokenizer.ggml.pre`` -> the regexes llama.cpp splits a text with, in order, before
    #: the byte-level encoding (:func:`sgl.model_loader.tokenizer.load_tokenizer` applies them)
    pre_tokenizer_splits: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def complete(self, meta: GGUFMetadata, config: PretrainedConfig) -> None:
        """Add to ``config`` (transformers' reading of the file) what the metadata says and
        transformers left out: the fields of every architecture
        (:func:`~sgl.model_loader.gguf_config.complete_common`), then this one's own."""
        from sgl.model_loader.gguf_config import complete_common

        complete_common(meta, config, self.fixed_attention_bias)
        if self.complete_config is not None:
            self.complete_config(meta, config)

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


def gguf_archs_of(registries: Any) -> dict[str, GGUFArch]:
    """The GGUF architectures the plugins of ``registries`` (:class:`sgl.plugins.Registries`)
    registered, by name; ValueError for an entry that is not a :class:`GGUFArch`."""
    archs = {}
    for entry in registries.gguf_archs:
        arch = entry.load()
        if not isinstance(arch, GGUFArch) or arch.name != entry.name:
            raise ValueError(f"plugin {entry.owner!r} registered GGUF architecture "
                             f"{entry.name!r} as {arch!r}, not a GGUFArch of that name")
        archs[entry.name] = arch
    return archs


def installed_gguf_archs() -> dict[str, GGUFArch]:
    """The GGUF architectures of the installed plugins
    (:func:`sgl.plugins.installed_plugin_manager`), for a caller that has no registries of its
    own."""
    from sgl.plugins import installed_plugin_manager

    return gguf_archs_of(installed_plugin_manager().registries)


def gguf_arch(name: str, archs: Mapping[str, GGUFArch], path: object = None) -> GGUFArch:
    """The rules of GGUF architecture ``name`` among ``archs`` (:func:`gguf_archs_of`).

    :raises ModelLoadError: naming the architecture and the supported ones."""
    arch = archs.get(name)
    if arch is None:
        where = f"GGUF file {str(path)!r} has" if path is not None else "GGUF"
        supported = ", ".join(sorted(archs)) or "none (no model plugin registers one)"
        raise ModelLoadError(f"{where} architecture {name!r}, which sgl does not load; supported "
                             f"GGUF architectures: {supported}")
    return arch
