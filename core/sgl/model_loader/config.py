"""Reading a model's Hugging Face config, from a folder or from GGUF metadata."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sgl.model_loader.errors import ModelLoadError
from sgl.model_loader.formats import installed_weight_formats
from sgl.model_loader.gguf_archs import installed_gguf_archs
from sgl.model_loader.gguf_cache import cached_from_gguf
from sgl.model_loader.paths import is_gguf, resolve_model_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.model_loader.formats import WeightFormat
    from sgl.model_loader.gguf_archs import GGUFArch

__all__ = ["load_hf_config", "quantization_config"]

def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def quantization_config(path: Path, formats: Mapping[str, type[WeightFormat]] | None = None
                        ) -> dict[str, Any] | None:
    """The quantization settings of the model folder ``path``: ``config.json``'s
    ``quantization_config``, else what an older checkpoint keeps in a file of its own (a
    format's :attr:`~sgl.model_loader.formats.WeightFormat.settings_files`, of ``formats``,
    default the installed plugins'; with the ``quant_method`` the file implies), else None."""
    quant = (_read_json(path / "config.json") or {}).get("quantization_config")
    if isinstance(quant, dict):
        return quant
    for fmt in (installed_weight_formats() if formats is None else formats).values():
        for name in fmt.settings_files:
            stored = _read_json(path / name)
            if stored is not None:
                return {"quant_method": fmt.name, **stored}
    return None


def _default_architecture(model_type: str) -> str | None:
    """The causal-LM class transformers would use for ``model_type`` (GGUF carries none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def _gguf_config(path: Path, archs: Mapping[str, GGUFArch]) -> PretrainedConfig:
    """transformers' config of a GGUF file, completed from the metadata it does not read (see
    :mod:`sgl.model_loader.gguf_config`); :class:`ModelLoadError` for an architecture no plugin
    of ``archs`` loads."""
    from transformers import AutoConfig

    from sgl.model_loader.gguf_archs import gguf_arch
    from sgl.model_loader.gguf_config import GGUFMetadata, read_gguf

    meta = GGUFMetadata(read_gguf(path))
    arch = gguf_arch(meta.arch, archs, path)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    arch.complete(meta, config)
    return config


def load_hf_config(path: str | Path | None,
                   gguf_archs: Mapping[str, GGUFArch] | None = None,
                   weight_formats: Mapping[str, type[WeightFormat]] | None = None
                   ) -> PretrainedConfig:
    """The :class:`transformers.PretrainedConfig` of a model folder or ``.gguf`` file.

    GGUF files store no ``architectures``; it is filled in from the model type
    (``llama`` -> ``LlamaForCausalLM``) so that the runner can pick the model class. What
    transformers does not read from a GGUF file's metadata is added by
    :meth:`~sgl.model_loader.gguf_archs.GGUFArch.complete`.

    :param path: as for :func:`~sgl.model_loader.resolve_model_path` (None: the bundled model).
    :param gguf_archs: the GGUF architectures the plugins registered
        (:func:`~sgl.model_loader.gguf_archs.gguf_archs_of`); None: the installed plugins'.
    :param weight_formats: the checkpoint formats the plugins registered
        (:func:`~sgl.model_loader.formats.weight_formats_of`); None: the installed plugins'.
    :raises ModelLoadError: when the path is missing or the config cannot be read.
    """
    from transformers import AutoConfig

    resolved = resolve_model_path(path)
    try:
        if is_gguf(resolved):
            # "config-2": entries of the earlier, incomplete GGUF configs are not reused
            if gguf_archs is None:
                gguf_archs = installed_gguf_archs()
            archs = gguf_archs
            config = cached_from_gguf(resolved, "config-2",
                                      lambda: _gguf_config(resolved, archs),
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
        stored = quantization_config(resolved, weight_formats)  # an older checkpoint's file
        if stored is not None:
            config.quantization_config = stored
    if not getattr(config, "architectures", None):
        arch = _default_architecture(getattr(config, "model_type", ""))
        if arch is not None:
            config.architectures = [arch]
    return config
