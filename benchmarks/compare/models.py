"""Which model the comparison runs (``--model``), and which engines make sense for it.

``--model`` is one of:

- ``smollm2`` (the default): the bundled SmolLM2-135M-Instruct Q4_1 GGUF;
- a ``.gguf`` file: the GGUF engines serve that very file, the others a bfloat16 Hugging Face
  folder written from it by sgl's GGUF reader;
- a Hugging Face folder (config.json and safetensors), used as it is;
- a ladder rung (``ladder.LADDER``): random weights of a published shape.

Every model has GGUF *kinds*: the given GGUF's own (``q4_1`` for smollm2) and those converted
from the Hugging Face folder with llama.cpp (:data:`CONVERTED_KINDS`). An engine is ``sgl``,
``vllm`` or ``transformers`` (the folder), or ``sgl-gguf-<kind>`` / ``llama-server-<kind>`` (a
GGUF file).
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compare.ladder import LADDER

#: ``bf16`` by llama.cpp's convert_hf_to_gguf.py; the others by llama-quantize from it
QUANTIZED_KINDS = ("q8_0", "q4_k_m", "q5_k_m", "q6_k")
CONVERTED_KINDS = ("bf16", *QUANTIZED_KINDS)
GGUF_ENGINES = ("sgl-gguf-", "llama-server-")
#: the suffix of a llama-server engine run with ``--no-repack``: its quantized blocks left in
#: ggml's plain CPU buffers instead of repacked for its AVX2/AVX-512 kernels, which is faster
#: for it at some concurrencies and slower at others (both are its own settings)
NO_REPACK = "-norepack"
#: sgl on the Hugging Face folder with its int8 weights and activations (SGLang's w8a8_int8)
W8A8_ENGINE = "sgl-w8a8"


@dataclass(frozen=True)
class Model:
    """:param name: as given to ``--model`` (a path for a file or folder).
    :param slug: the folder under ``<peers-dir>/models/`` and the name the servers serve.
    :param origin: ``gguf``, ``hf`` or ``ladder``.
    :param path: the given GGUF file or Hugging Face folder (None for a ladder rung).
    :param own_kind: the kind of the given GGUF file (its ``general.file_type``)."""

    name: str
    slug: str
    origin: str
    path: Path | None = None
    own_kind: str | None = None

    @property
    def kinds(self) -> tuple[str, ...]:
        own = (self.own_kind,) if self.own_kind else ()
        return own + tuple(k for k in CONVERTED_KINDS if k != self.own_kind)

    @property
    def engines(self) -> tuple[str, ...]:
        return ("sgl", W8A8_ENGINE, *(f"sgl-gguf-{k}" for k in self.kinds), "vllm",
                *(f"llama-server-{k}" for k in self.kinds),
                *(f"llama-server-{k}{NO_REPACK}" for k in self.kinds if k != "bf16"),
                "transformers")

    @property
    def default_engines(self) -> list[str]:
        """Each engine on its own best format and on the one the others run: for a GGUF, sgl
        and llama-server on the file, llama-server also on bf16 and Q8_0, and transformers
        (the set before ``--model`` for smollm2); for a folder or a rung (up to 8B, where
        transformers' static batches are slow), sgl and llama-server on every quantized kind,
        llama-server also on bf16, and no transformers. sgl also serves the folder in its int8
        compute mode (``sgl-w8a8``: ``--quantization w8a8_int8``) everywhere."""
        if self.origin == "gguf":
            llama = dict.fromkeys(("bf16", "q8_0", self.own_kind))
            return ["sgl", W8A8_ENGINE, f"sgl-gguf-{self.own_kind}", "vllm",
                    *(f"llama-server-{k}" for k in llama), "transformers"]
        return ["sgl", W8A8_ENGINE, *(f"sgl-gguf-{k}" for k in QUANTIZED_KINDS), "vllm",
                *(f"llama-server-{k}" for k in CONVERTED_KINDS)]

    def check_engine(self, engine: str) -> str | None:
        """None when ``engine`` can run on this model, else why not."""
        if engine in self.engines:
            return None
        kind = gguf_kind(engine)
        if kind is not None:
            return (f"{engine!r} makes no sense for model {self.slug}: it has no {kind} GGUF "
                    f"(its kinds: {', '.join(self.kinds)})")
        return f"unknown engine {engine!r}; choose from {', '.join(self.engines)}"

    def describe(self, hf_folder: Path) -> dict[str, Any]:
        """The results file's ``model``: which model and shape every table is for."""
        config = json.loads((hf_folder / "config.json").read_text())
        if self.origin == "ladder":
            source = LADDER[self.name].source
            label = f"{self.slug} (random weights)"
            how = (f"random bfloat16 weights of {source}'s shape with SmolLM2's tokenizer and "
                   "vocabulary; llama.cpp's GGUFs converted from that folder")
        elif self.origin == "hf":
            source, label = str(self.path), self.path.name
            how = "the Hugging Face folder as given; llama.cpp's GGUFs converted from it"
        else:
            source = str(self.path)
            label = "SmolLM2-135M-Instruct" if self.slug == "smollm2" else self.path.name
            how = (f"the {self.own_kind.upper()} GGUF {self.path.name}, dequantized by sgl's "
                   "reader to one bfloat16 Hugging Face folder; llama.cpp's other GGUFs "
                   "converted from that folder")
        params = parameter_count(hf_folder)
        return {"name": self.slug, "label": label, "origin": self.origin, "source": source,
                "description": how, "parameters": params,
                "shape": f"{shape_summary(config)}, {_count(params)} parameters"}


def gguf_kind(engine: str) -> str | None:
    """The GGUF kind an engine serves (``llama-server-q8_0``: ``q8_0``, as
    ``llama-server-q8_0-norepack``); None for the others."""
    for prefix in GGUF_ENGINES:
        if engine.startswith(prefix) and len(engine) > len(prefix):
            kind = engine.removeprefix(prefix)
            return kind.removesuffix(NO_REPACK) if prefix == "llama-server-" else kind
    return None


@functools.cache
def file_kind(gguf: Path) -> str:
    """A GGUF file's kind from its ``general.file_type`` (``MOSTLY_Q4_K_M``: ``q4_k_m``)."""
    import gguf as gguf_py

    from sgl.model_loader.gguf_config import GGUFMetadata, read_gguf

    file_type = GGUFMetadata(read_gguf(gguf)).get("general.file_type")
    if file_type is None:
        return "gguf"
    name = gguf_py.LlamaFileType(int(file_type)).name
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def shape_summary(config: dict[str, Any]) -> str:
    """``config.json`` in one line: architecture, sizes, experts, vocabulary."""
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads")
    parts = [(config.get("architectures") or [config.get("model_type", "?")])[0],
             f"hidden {config['hidden_size']}", f"{config['num_hidden_layers']} layers",
             f"{heads} heads ({kv or heads} KV)"]
    if config.get("num_experts"):
        parts.append(f"{config['num_experts']} experts of {config['moe_intermediate_size']} "
                     f"({config['num_experts_per_tok']} per token)")
        if config.get("shared_expert_intermediate_size"):
            parts.append(f"shared expert {config['shared_expert_intermediate_size']}")
    else:
        parts.append(f"MLP {config['intermediate_size']}")
    tied = "tied" if config.get("tie_word_embeddings") else "untied"
    parts.append(f"vocabulary {config['vocab_size']} ({tied} embeddings)")
    return ", ".join(parts)


def parameter_count(folder: Path) -> int:
    """The parameters in a folder's safetensors files (read from their headers)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            total += sum(math.prod(handle.get_slice(k).get_shape()) for k in handle.keys())
    return total


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "model"


def resolve_model(name: str) -> Model:
    """The model ``--model`` names; raises ValueError saying what it takes."""
    if name == "smollm2":
        from sgl.model_loader import bundled_model_path

        path = bundled_model_path()
        return Model(name, "smollm2", "gguf", path, file_kind(path))
    if name in LADDER:
        return Model(name, name, "ladder")
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return Model(name, _slug(path.resolve().name), "hf", path.resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return Model(name, _slug(path.stem), "gguf", path.resolve(), file_kind(path.resolve()))
    raise ValueError(f"{name!r} is neither smollm2, a ladder model ({', '.join(LADDER)}), a "
                     "Hugging Face folder with config.json nor a .gguf file")
