"""Loading the tokenizer that belongs to a model."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from sgl.model_loader.errors import ModelLoadError
from sgl.model_loader.gguf_archs import installed_gguf_archs
from sgl.model_loader.gguf_cache import cached_from_gguf
from sgl.model_loader.paths import is_gguf, resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from sgl.model_loader.gguf_archs import GGUFArch

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
            archs = installed_gguf_archs()

            def build() -> PreTrainedTokenizerBase:
                tokenizer = AutoTokenizer.from_pretrained(str(resolved.parent),
                                                          gguf_file=resolved.name)
                _restore_pre_tokenizer(tokenizer, resolved, archs)
                return tokenizer

            # the splits the plugins know are part of what is cached: a change rebuilds it
            known = repr(sorted((name, sorted(arch.pre_tokenizer_splits.items()))
                                for name, arch in archs.items()))
            kind = f"tokenizer-{hashlib.sha256(known.encode()).hexdigest()[:8]}"
            return cached_from_gguf(resolved, kind, build, AutoTokenizer.from_pretrained)
        return AutoTokenizer.from_pretrained(str(resolved))
    except Exception as exc:  # transformers raises many types for unreadable files
        raise ModelLoadError(
            f"cannot load a tokenizer from {str(resolved)!r}: {type(exc).__name__}: {exc}"
        ) from exc


def _restore_pre_tokenizer(tokenizer: PreTrainedTokenizerBase, path: Path,
                           archs: Mapping[str, GGUFArch]) -> None:
    """Split texts as the model's own tokenizer does where transformers' GGUF reading does not:
    a ``tokenizer.ggml.pre`` type that the file's architecture plugin knows
    (:attr:`~sgl.model_loader.gguf_archs.GGUFArch.pre_tokenizer_splits`) gets llama.cpp's
    regexes in order, then the byte-level encoding. Without it transformers falls back to
    GPT-2's split, which tokenizes some texts differently from the model's training (runs of
    spaces before a digit, for one)."""
    from tokenizers import Regex, pre_tokenizers

    from sgl.model_loader.gguf_config import GGUFMetadata, read_gguf

    meta = GGUFMetadata(read_gguf(path))
    arch = archs.get(str(meta.get("general.architecture", "")))
    splits = arch.pre_tokenizer_splits.get(str(meta.get("tokenizer.ggml.pre", ""))) \
        if arch is not None else None
    if splits:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
