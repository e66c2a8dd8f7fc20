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


#: GPT-2's split, the second of llama.cpp's ``smollm`` regexes
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

#: SmolLM's tokenizer splits every digit off before GPT-2's split (``tokenizer.ggml.pre``
#: ``smollm``), which transformers' GGUF reading leaves out
LLAMA = GGUFArch("llama", DECODER_LAYER_NAMES, permuted_qk=True, complete_config=_complete,
                 pre_tokenizer_splits={"smollm": (r"\p{N}", _GPT2_SPLIT)})
