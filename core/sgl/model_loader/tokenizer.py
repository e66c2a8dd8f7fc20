"""Loading the tokenizer that belongs to a model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sgl.model_loader.errors import ModelLoadError
from sgl.model_loader.gguf_cache import cached_from_gguf
from sgl.model_loader.paths import is_gguf, resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["load_tokenizer"]


def load_tokenizer(path: str | Path | None) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer of a model folder or ``.gguf`` file (None: the bundled model).

    Building it from GGUF metadata takes a few seconds.

    :raises ModelLoadError: when the path is missing or holds no usable tokenizer.
    """
    from transformers import AutoTokenizer

    resolved = resolve_model_path(path)
    try:
        if is_gguf(resolved):
            return cached_from_gguf(
                resolved, "tokenizer",
                lambda: AutoTokenizer.from_pretrained(str(resolved.parent),
                                                      gguf_file=resolved.name),
                AutoTokenizer.from_pretrained)
        return AutoTokenizer.from_pretrained(str(resolved))
    except Exception as exc:  # transformers raises many types for unreadable files
        raise ModelLoadError(
            f"cannot load a tokenizer from {str(resolved)!r}: {type(exc).__name__}: {exc}"
        ) from exc
