"""Reading a model's Hugging Face config, from a folder or from GGUF metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgl.model_loader.errors import ModelLoadError
from sgl.model_loader.gguf_cache import cached_from_gguf
from sgl.model_loader.paths import is_gguf, resolve_model_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["load_hf_config", "quantization_config"]

#: where older checkpoints keep their quantization settings when ``config.json`` has none, and
#: the ``quant_method`` they imply: AutoGPTQ's ``quantize_config.json``, AutoAWQ's
#: ``quant_config.json``
QUANTIZATION_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def quantization_config(path: Path) -> dict[str, Any] | None:
    """The quantization settings of the model folder ``path``: ``config.json``'s
    ``quantization_config``, else what an older AutoGPTQ or AutoAWQ checkpoint keeps in its own
    file (:data:`QUANTIZATION_FILES`, with the ``quant_method`` it implies), else None."""
    quant = (_read_json(path / "config.json") or {}).get("quantization_config")
    if isinstance(quant, dict):
        return quant
    for name, method in QUANTIZATION_FILES:
        stored = _read_json(path / name)
        if stored is not None:
            return {"quant_method": method, **stored}
    return None


def _default_architecture(model_type: str) -> str | None:
    """The causal-LM class transformers would use for ``model_type`` (GGUF carries none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def _gguf_config(path: Path) -> PretrainedConfig:
    """transformers' config of a GGUF file, completed from the metadata it does not read (see
    :mod:`sgl.model_loader.gguf_config`); :class:`ModelLoadError` for an architecture sgl does
    not load."""
    from transformers import AutoConfig

    from sgl.model_loader.gguf_archs import gguf_arch
    from sgl.model_loader.gguf_config import GGUFMetadata, complete_config, read_gguf

    meta = GGUFMetadata(read_gguf(path))
    gguf_arch(meta.arch, path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    complete_config(meta, config)
    return config


def load_hf_config(path: str | Path | None) -> PretrainedConfig:
    """The :class:`transformers.PretrainedConfig` of a model folder or ``.gguf`` file.

    GGUF files store no ``architectures``; it is filled in from the model type
    (``llama`` -> ``LlamaForCausalLM``) so that the runner can pick the model class. What
    transformers does not read from a GGUF file's metadata is added by
    :func:`~sgl.model_loader.gguf_config.complete_config`.

    :param path: as for :func:`~sgl.model_loader.resolve_model_path` (None: the bundled model).
    :raises ModelLoadError: when the path is missing or the config cannot be read.
    """
    from transformers import AutoConfig

    resolved = resolve_model_path(path)
    try:
        if is_gguf(resolved):
            # "config-2": entries of the earlier, incomplete GGUF configs are not reused
            config = cached_from_gguf(resolved, "config-2", lambda: _gguf_config(resolved),
                                      AutoConfig.from_pretrained)
        else:
            config = AutoConfig.from_pretrained(str(resolved))
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers raises many types for unreadable files
        raise ModelLoadError(
            f"cannot read the model config from {str(resolved)!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not is_gguf(resolved) and not getattr(config, "quantization_config", None):
        stored = quantization_config(resolved)  # an older checkpoint's own file
        if stored is not None:
            config.quantization_config = stored
    if not getattr(config, "architectures", None):
        arch = _default_architecture(getattr(config, "model_type", ""))
        if arch is not None:
            config.architectures = [arch]
    return config
