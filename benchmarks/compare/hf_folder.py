"""Writing the bfloat16 Hugging Face folder that sgl, vLLM, transformers and llama.cpp's converter
read: from a GGUF file (through sgl's own GGUF reader, so the tensors are those sgl serves) or
from a ladder rung (random weights, see ``ladder.py``).

The weights go out shard by shard (``model-00001-of-0000N.safetensors`` of about
:data:`SHARD_BYTES` each, plus ``model.safetensors.index.json``), so no more than one shard is
ever in memory. The folder is written as ``<name>.partial`` and renamed when complete: an
interrupted run leaves no half model, and the next run starts the folder again.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger("compare")

SHARD_BYTES = 512 << 20
INDEX_FILE = "model.safetensors.index.json"


def write_shards(folder: Path, tensors: Iterable[tuple[str, torch.Tensor]],
                 shard_bytes: int | None = None) -> int:
    """Save ``(name, tensor)`` pairs as safetensors shards of about ``shard_bytes`` (default
    :data:`SHARD_BYTES`) and the index; returns the number of shards."""
    from safetensors.torch import save_file

    shard_bytes = shard_bytes or SHARD_BYTES
    shard: dict[str, torch.Tensor] = {}
    files: list[list[str]] = []  # the tensor names of each shard written
    total = size = 0

    def flush() -> None:
        nonlocal shard, size
        save_file(shard, str(folder / f"model-{len(files) + 1:05d}.safetensors"),
                  metadata={"format": "pt"})
        files.append(list(shard))
        shard, size = {}, 0

    for name, tensor in tensors:
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and size + nbytes > shard_bytes:
            flush()
        shard[name] = tensor
        size += nbytes
        total += nbytes
    if shard:
        flush()
    weight_map = {}
    for i, names in enumerate(files, 1):  # the usual names, now that the count is known
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        (folder / f"model-{i:05d}.safetensors").rename(folder / final)
        weight_map.update(dict.fromkeys(names, final))
    (folder / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    return len(files)


def _write_config(config: PretrainedConfig, folder: Path) -> None:
    """config.json (with ``architectures``, ``torch_dtype`` and, beside ``transformers`` 5's
    ``rope_parameters``, the ``rope_theta``/``rope_scaling`` keys older readers such as llama.cpp's
    converter look for) and generation_config.json."""
    config.save_pretrained(folder)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    rope = dict(data.get("rope_parameters") or {})
    data["torch_dtype"] = "bfloat16"
    if "rope_theta" in rope:
        data.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") != "default":
        data.setdefault("rope_scaling", rope)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    (folder / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}) + "\n")


def write_folder(folder: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase,
                 tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]]) -> Path:
    """Write ``folder`` (config, tokenizer, the weights ``tensors()`` yields) through a
    ``.partial`` folder renamed at the end."""
    staging = folder.with_name(folder.name + ".partial")
    if staging.exists():  # what an interrupted run left
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    _write_config(config, staging)
    tokenizer.save_pretrained(staging)
    shards = write_shards(staging, tensors())
    staging.rename(folder)
    logger.info("wrote %s (%d weight shards)", folder, shards)
    return folder


def folder_from_gguf(gguf: Path, folder: Path) -> Path:
    """A GGUF file as a bfloat16 Hugging Face folder, written by sgl's GGUF reader, with the
    tokenizer (sgl's, which splits texts as llama.cpp does, so that llama.cpp's converter
    recognises it) and chat template from the GGUF."""
    import torch

    from sgl.model_loader import iter_weights, load_hf_config, load_tokenizer

    logger.info("writing %s as a Hugging Face folder: %s", gguf, folder)
    config = load_hf_config(gguf)
    return write_folder(folder, config, load_tokenizer(gguf),
                        lambda: iter_weights(gguf, torch.bfloat16))


def folder_from_ladder(name: str, folder: Path, **overrides: Any) -> Path:
    """Ladder rung ``name`` as a folder of random bfloat16 weights with the bundled model's
    tokenizer; ``overrides`` (config fields) shrink it in tests."""
    from compare.ladder import ladder_config, random_tensors
    from sgl.model_loader import bundled_model_path, load_hf_config, load_tokenizer

    logger.info("writing random weights of %s's shape: %s", name, folder)
    bundled = bundled_model_path()
    base = load_hf_config(bundled)
    config = ladder_config(name, vocab_size=base.vocab_size, bos_token_id=base.bos_token_id,
                           eos_token_id=base.eos_token_id, **overrides)
    return write_folder(folder, config, load_tokenizer(bundled),
                        lambda: random_tensors(config))
