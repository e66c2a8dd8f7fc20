"""The ``llama`` GGUF architecture: Llama, and Mistral as llama.cpp converts it.

llama.cpp's converter interleaves the rows of q and k within each head
(``LlamaModel.permute``); sgl undoes it. llama.cpp attends to the whole context unless the file
names a sliding window, where transformers' MistralConfig would default to 4096.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sgl.model_loader.gguf_archs import DECODER_LAYER_NAMES, GGUFArch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from sgl.model_loader.gguf_config import GGUFMetadata

__all__ = ["LLAMA"]


def _complete(meta: GGUFMetadata, config: PretrainedConfig) -> None:
    window = meta.arch_get("attention.sliding_window")
    if config.model_type == "mistral" or window is not None:
        config.sliding_window = int(window) if window else None


LLAMA = GGUFArch("llama", DECODER_LAYER_NAMES, permuted_qk=True, complete_config=_complete)
